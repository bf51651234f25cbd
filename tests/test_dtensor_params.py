"""The parallel module's parameters are ``DTensor``s carrying the plan's placements
(``codegen/build.py``), so that what torch does with parameters sees the sharding.

On 4 gloo ranks, against the single-device model, for parameters sharded by tensor parallelism,
whole under sequence parallelism (a mesh axis given ``AxisRole.SEQUENCE``: each rank's gradient
is its sequence piece's, summed after backward), sharded by ZeRO-3 (FSDP2's shards over
the data axis of a 2 x 2 data x tensor mesh) and by ZeRO-1 (the optimizer's shares):

* ``torch.nn.utils.clip_grad_norm_(pmodel.parameters(), max_norm)`` returns the single-device
  model's total norm and clips as it does (without ``DTensor`` parameters each rank's norm would
  be its own shard's: 0.986 where the whole model's is 1.961); ``pmodel.clip_grad_norm_`` agrees;
* Adam, foreach and fused, steps the clipped gradients to the single-device model's weights;
* the parameters' placements are the plan's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import D, S, T, assert_adam_state_close, collective_axes, free_link_cpu, labelled
from torch.distributed.tensor import DTensor

import autopar
from autopar.codegen.zero import SPMD_FSDP
from autopar.examples import llama_tiny
from autopar.launch import run_on_ranks
from autopar.placement import is_shard
from autopar.trades import Trades, ZeroStage

MAX_NORM = 0.5  # below the model's gradient norm: clipping scales every gradient
LR = 1e-3  # Adam normalizes each gradient: a larger rate magnifies rounding in near-zero ones
# name -> (mesh, roles, ZeRO stage, Adam's implementation)
CASES = {
    "tensor": ((4,), (T,), 0, "foreach"),
    "sequence": ((4,), (S,), 0, "fused"),
    "zero3 x tensor": ((2, 2), (D, T), 3, "foreach"),
    "zero1": ((4,), (D,), 1, "fused"),
}


def _build():
    return llama_tiny(batch=4, seq=16, hidden=32, vocab=128)


def _rank(rank, world, jobs):
    out = {}
    for name, path in jobs:
        model, inputs = _build()
        pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=path)
        impl = CASES[name][3]
        opt = pmodel.optimizer(torch.optim.Adam, lr=LR, **{impl: True})
        pmodel(**inputs).loss.backward()
        if CASES[name][2] >= 2 and not SPMD_FSDP:
            # torch < 2.13: FSDP2's parameters are on the data axis's mesh, the others on the
            # module's, which torch's clip_grad_norm_ cannot combine (autopar warns): the module's
            norm = pmodel.clip_grad_norm_(MAX_NORM)
        else:
            norm = torch.nn.utils.clip_grad_norm_(pmodel.parameters(), MAX_NORM)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        clipped = pmodel.full_grads()
        opt.step()
        opt.zero_grad()
        pmodel(**inputs).loss.backward()
        again = pmodel.clip_grad_norm_(MAX_NORM)  # the module's own, on the next step's gradients
        out[name] = {
            "norm": norm.item(),
            "clipped": clipped,
            "state": pmodel.full_state_dict(),
            "again": again.item(),
            "dtensor": all(isinstance(p, DTensor) for p in pmodel.parameters()),
            # what is sharded: the parameters (tensor parallelism, ZeRO-3) or ZeRO-1's optimizer shares
            "sharded": any(
                any(is_shard(q) for q in p.placements)
                for p in [*pmodel.parameters(), *getattr(opt, "shares", {}).values()]
            ),
            "axes": collective_axes(pmodel),
        }
    return out


def _reference():
    model, inputs = _build()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    model(**inputs).loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
    clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model(**inputs).loss.backward()
    again = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
    return norm, clipped, state, again


@pytest.mark.slow
def test_clip_grad_norm_and_optimizers_see_the_whole_model(tmp_path):
    model, inputs = _build()
    jobs = []
    for name, (mesh, roles, zero, _) in CASES.items():
        plan = autopar.plan(model, free_link_cpu(4), inputs, mesh_shape=mesh, axis_roles=roles)
        if zero:
            plan = dataclasses.replace(plan, trades=Trades(zero_stage=ZeroStage(zero), data_axes=(0,)))
        path = tmp_path / f"{name.replace(' ', '_')}.json"
        plan.save(path)
        jobs.append((name, str(path)))
    norm, clipped, state, again = _reference()
    assert norm > 2 * MAX_NORM  # the clip bites
    for rank, res in enumerate(run_on_ranks(_rank, 4, jobs, timeout_s=600)):
        for name in CASES:
            got = res[name]
            where = f"{name}, rank {rank}"
            assert got["dtensor"], f"{where}: a parameter is not a DTensor"
            # sequence parallelism keeps the weights whole; their gradients are sums over the pieces
            assert got["sharded"] or name == "sequence", (
                f"{where}: no parameter is sharded: the case tests nothing"
            )
            assert got["axes"], f"{where}: the plan runs no collective: the case tests nothing"
            assert got["norm"] == pytest.approx(norm, rel=1e-5), where
            for k, g in clipped.items():
                torch.testing.assert_close(
                    got["clipped"][k], g, rtol=1e-4, atol=1e-6, msg=labelled(f"{where}: {k}")
                )
            for k, v in state.items():
                assert_adam_state_close(got["state"][k], v, LR, 1, f"{where}: {k}")
            assert got["again"] == pytest.approx(again, rel=1e-4), where
