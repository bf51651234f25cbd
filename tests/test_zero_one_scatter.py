"""ZeRO-1 reduce-scatters its gradient buckets into the optimizer's shares (``codegen/grad_sync.py``,
``passes/grad_sync.py:scatters``), on gloo.

The parent plans GPT-2 (tiny) with ZeRO-1 forced on a (2,) data mesh (world 2), a (3,) one (world
3: no dim divides by 3, so every share is cut unevenly, as ``torch.chunk`` and DTensor cut), a (2, 2) data x
tensor mesh and a (2, 2) mesh whose two axes both split the batch (ZeRO-1 over both: shares cut
over 4 ranks, reduce-scattered one axis after the other). Each rank trains three Adam steps; the
second step's backward runs twice without zeroing (gradients accumulated onto the shares the first
left). Checked against one device: after the first backward, ``full_grads()`` equals the model's
gradients and ``pmodel.clip_grad_norm_`` its total norm (the shares read as ``DTensor``s), and
every parameter of a reduce-scattered bucket has a ``.grad`` of this rank's share of its piece
(``torch.chunk``'s cut; a parameter reduced inline, not in a bucket, keeps its whole gradient); the
losses, Adam's first moments gathered whole from the shares' ``DTensor`` state
(``optimizer_state_dict``: the shares' placements say where each piece is) and the full state after
the steps (``harness.assert_adam_state_close``). The plan's buckets marked ``scatter`` are
the ones the runtime reduce-scatters, and their count is what ran.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from harness import D, T, assert_adam_state_close

import autopar
from autopar.codegen import zero_one
from autopar.examples import gpt2_tiny
from autopar.launch import run_on_ranks
from autopar.trades import Trades, ZeroStage

LR = 1e-3
STEPS = 3
MESHES = {
    "d2": ((2,), (D,), (0,)),
    "d3": ((3,), (D,), (0,)),  # no dim divides by 3: uneven shares (torch.chunk's cut), padded collectives
    "d2t2": ((2, 2), (D, T), (0,)),
    "d2d2": ((2, 2), (D, D), (0, 1)),
}


def _build():
    return gpt2_tiny(batch=12, seq=16, hidden=32, vocab=128)


def _reference():
    """One device: the first backward's gradients and norm, the losses and the state after the
    steps, the second step's gradient accumulated over two backwards."""
    model, inputs = _build()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, grads, norm = [], None, None
    for step in range(STEPS):
        for _ in range(2 if step == 1 else 1):
            loss = model(**inputs).loss
            loss.backward()
            losses.append(loss.item())
        if step == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        opt.step()
        opt.zero_grad()
        if step == STEPS - 1:  # the moments before the last zero_grad
            names = {id(p): k for k, p in model.named_parameters()}
            moments = {names[id(p)]: st["exp_avg"].clone() for p, st in opt.state.items()}
    return losses, grads, norm, moments, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank(rank, world, path):
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    model, inputs = _build()
    pmodel = autopar.autoparallelize(model, cluster, inputs, plan=path)
    opt = pmodel.optimizer(torch.optim.Adam, lr=LR)
    sync = pmodel.grad_sync
    out = dict(losses=[], scattered=[])
    for step in range(STEPS):
        for _ in range(2 if step == 1 else 1):
            loss = pmodel(**inputs).loss
            loss.backward()
            out["losses"].append(loss.item())
        if step == 0:
            out["grads"] = pmodel.full_grads()
            out["norm"] = pmodel.clip_grad_norm_(1e9).item()  # reads, scales by 1
            for b in sync._buckets:
                if b.scatter:  # (rows of .grad, rows of this rank's share: torch.chunk's cut)
                    d = math.prod(pmodel.mesh.size(a) for a in b.scatter)
                    r = zero_one.share_index(pmodel.mesh, b.scatter)
                    for p in b.params:
                        rows = p._local_tensor.shape[0]
                        chunks = torch.arange(rows).chunk(d)
                        want = len(chunks[r]) if r < len(chunks) else 0
                        out["scattered"].append((p.grad._local_tensor.shape[0], want, rows))
        opt.step()
        opt.zero_grad()
    # Adam's first moments, each gathered whole from the shares' DTensor state
    out["moments"] = {
        k: v["exp_avg"].full_tensor()
        for k, v in pmodel.optimizer_state_dict(opt)["state"].items()
        if "exp_avg" in v
    }
    out["scatters"] = sync.scatters
    out["reductions"] = sync.reductions
    out["planned"] = sum(1 for b in sync._buckets if b.scatter)
    out["full"] = pmodel.full_state_dict()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(MESHES))
def test_zero_one_reduce_scatters_into_shares_and_trains_as_one_device(case, tmp_path):
    mesh, roles, data = MESHES[case]
    world = math.prod(mesh)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    model, inputs = _build()
    plan = autopar.plan(model, cluster, inputs, mesh_shape=mesh, axis_roles=roles)
    path = tmp_path / f"zero1_{case}.json"
    dataclasses.replace(plan, trades=Trades(zero_stage=ZeroStage.OPTIMIZER, data_axes=data)).save(path)
    per_rank = run_on_ranks(_rank, world, str(path), timeout_s=300)
    losses, grads, norm, moments, state = _reference()
    for rank, r in enumerate(per_rank):
        where = f"{case} rank {rank}"
        assert r["planned"] > 0, f"{where}: no bucket planned as a reduce-scatter"
        # one backward in steps 0 and 2, two in step 1: each scattered bucket reduced once a backward
        assert r["scatters"] == 4 * r["planned"], where
        # each .grad this rank's share of its piece, cut as torch.chunk (and DTensor) cut it
        assert r["scattered"] and all(got == want for got, want, _ in r["scattered"]), (where, r["scattered"])
        if case == "d3":
            assert any(rows % 3 for _, _, rows in r["scattered"]), f"{where}: no uneven share"
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), rtol=1e-4, atol=1e-5)
        for k, g in grads.items():
            torch.testing.assert_close(r["grads"][k], g, rtol=1e-4, atol=1e-6, msg=f"{where}: grad {k}")
        assert r["norm"] == pytest.approx(norm, rel=1e-4), where
        assert set(r["moments"]) == set(moments), where
        for k, m in moments.items():
            torch.testing.assert_close(r["moments"][k], m, rtol=1e-4, atol=1e-7, msg=f"{where}: exp_avg {k}")
        for k, v in state.items():
            assert_adam_state_close(r["full"][k], v, LR, STEPS, f"{where} {k}")
