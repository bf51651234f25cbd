"""Gradients as bucket views (codegen/grad_sync.py): on the plain-leaf path each data-parallel
gradient is written into its slice of its bucket's flat buffer and reduced there, with no
``torch.cat`` and no copy back. The gradients equal the single-device model's step after step,
``.grad`` aliases the bucket, the buffer is reused while nothing else holds the last step's
gradients, and a gradient a caller keeps is never overwritten by the next backward."""

from __future__ import annotations

import pytest
import torch
from harness import free_link_cpu

import autopar
from autopar.examples import gpt2_tiny
from autopar.launch import run_on_ranks
from autopar.passes import grad_sync
from autopar.passes.grad_sync import deferred_grad_axes, grad_buckets
from autopar.passes.strategies import AxisRole

LR, STEPS = 0.1, 3


def _build():
    return gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128)


def _reference() -> list[dict[str, torch.Tensor]]:
    """The single-device model's gradients at each backward of ``_rank``'s ``STEPS + 2`` SGD steps."""
    model, inputs = _build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for _ in range(STEPS + 2):
        model(**inputs).loss.backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return out


def _rank(rank, world, plan_path, bucket_bytes):
    grad_sync.BUCKET_BYTES = bucket_bytes
    model, inputs = _build()
    pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=plan_path)
    opt = pmodel.optimizer(torch.optim.SGD, lr=LR)
    gs = pmodel.grad_sync
    res = {"buckets": gs.num_buckets, "grads": [], "made": []}
    for _ in range(STEPS):
        pmodel(**inputs).loss.backward()
        res["grads"].append({k: v.clone() for k, v in pmodel.full_grads().items()})
        res["made"].append(gs.buffers_made)
        # every bucketed gradient is a slice of its bucket's buffer, as its parameter's own spec
        res["aliased"] = all(
            p.grad._local_tensor.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr()
            and p.grad._spec == p._spec
            for b in gs._buckets
            for p in b.params
        )
        opt.step()
        opt.zero_grad()
    # a caller keeps this step's gradients: the next backward writes into a new buffer
    pmodel(**inputs).loss.backward()
    kept = [p.grad for b in gs._buckets for p in b.params]
    values = [g._local_tensor.clone() for g in kept]
    opt.step()
    opt.zero_grad()
    pmodel(**inputs).loss.backward()
    res["kept_unchanged"] = all(torch.equal(g._local_tensor, v) for g, v in zip(kept, values))
    res["made_after_kept"] = gs.buffers_made
    res["last"] = {k: v.clone() for k, v in pmodel.full_grads().items()}
    return res


@pytest.mark.slow
@pytest.mark.parametrize("split", [False, True])
def test_bucket_views_match_single_device_and_alias_the_bucket(tmp_path, split):
    model, inputs = _build()
    path = tmp_path / "dp.json"
    res = autopar.search(
        model, free_link_cpu(2), inputs, mesh_shape=(2,), axis_roles=(AxisRole.DATA,), zero_stage=0
    )
    res.plan.save(path)
    deferred = deferred_grad_axes(res.traced, res.choice, (2,))
    (whole,) = grad_buckets(res.traced, res.choice, deferred, (2,))
    bucket_bytes = whole.nbytes / 3 if split else grad_sync.BUCKET_BYTES
    ref = _reference()
    for got in run_on_ranks(_rank, 2, str(path), bucket_bytes):
        n = got["buckets"]
        assert (n > 1) == split
        assert got["aliased"]
        assert got["made"] == [n] * STEPS, "the buffer is reused while nothing holds the last gradients"
        assert got["kept_unchanged"]
        assert got["made_after_kept"] == 2 * n, "kept gradients: a new buffer"
        for step, want in enumerate([*ref[:STEPS], ref[STEPS + 1]]):
            have = got["grads"][step] if step < STEPS else got["last"]
            assert set(have) <= set(want) and have
            for name, g in have.items():
                scale = want[name].abs().max().item()
                torch.testing.assert_close(
                    g, want[name], rtol=1e-4, atol=1e-5 * max(scale, 1.0), msg=f"{step} {name}"
                )
