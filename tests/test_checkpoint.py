"""Sharded checkpoints with ``torch.distributed.checkpoint`` (``codegen/state.py``), resumed under
another plan.

On 4 gloo ranks: a module built from one plan (2 x 2 data x tensor, no ZeRO) trains two Adam
steps, saves ``{"model": pmodel.state_dict(), "optim": pmodel.optimizer_state_dict(opt)}`` with
``dcp.save`` (each rank writes its own pieces: no file holds the whole), and trains two more.
Modules built from other plans (4-way ZeRO-3 data parallelism; 4-way tensor parallelism; 4-way
data parallelism with ZeRO-1) load that checkpoint with ``dcp.load`` into their own state dicts
and train the same two further steps: their losses and final weights equal the uninterrupted
run's, which equals the single-device model's. ``state_dict()`` is keyed by the model's own names
and holds ``DTensor``s with the plan's placements; ``full_state_dict(rank0_only=True)`` exports
the whole model to rank 0 alone.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import D, T, adam_reference, assert_adam_state_close, free_link_cpu
from torch.distributed.tensor import DTensor, Shard

import autopar
from autopar.examples import llama_tiny
from autopar.launch import run_on_ranks
from autopar.trades import Trades, ZeroStage

LR = 1e-3  # Adam normalizes each gradient: a larger rate magnifies rounding in near-zero ones
STEPS = 2  # before the checkpoint, and again after it
# name -> (mesh, roles, ZeRO stage)
PLANS = {
    "dp x tp": ((2, 2), (D, T), 0),
    "zero3": ((4,), (D,), 3),
    "tp": ((4,), (T,), 0),
    "zero1": ((4,), (D,), 1),
}
SAVER = "dp x tp"


def _build():
    return llama_tiny(batch=4, seq=16, hidden=32, vocab=128)


def _train(pmodel, opt, inputs, steps):
    losses = []
    for _ in range(steps):
        losses.append(pmodel.step(**inputs).item())
        opt.step()
        opt.zero_grad()
    return losses


def _rank(rank, world, plans, ckpt):
    out = {}
    model, inputs = _build()
    pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=plans[SAVER])
    opt = pmodel.optimizer(torch.optim.Adam, lr=LR)
    first = _train(pmodel, opt, inputs, STEPS)
    sd = pmodel.state_dict()
    out["names"] = sorted(sd)
    out["placements"] = {k: v.placements for k, v in sd.items() if isinstance(v, DTensor)}
    dcp.save({"model": sd, "optim": pmodel.optimizer_state_dict(opt)}, checkpoint_id=ckpt)
    out[SAVER] = (first, _train(pmodel, opt, inputs, STEPS), pmodel.full_state_dict())
    export = pmodel.full_state_dict(rank0_only=True, cpu=True)
    out["export"] = sorted(export) if export else []
    for name, path in plans.items():
        if name == SAVER:
            continue
        model, inputs = _build()  # fresh weights: everything the run needs comes from the checkpoint
        pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=path)
        opt = pmodel.optimizer(torch.optim.Adam, lr=LR)
        state = {"model": pmodel.state_dict(), "optim": pmodel.optimizer_state_dict(opt)}
        dcp.load(state, checkpoint_id=ckpt)
        pmodel.load_state_dict(state["model"])
        pmodel.load_optimizer_state_dict(opt, state["optim"])
        out[name] = (None, _train(pmodel, opt, inputs, STEPS), pmodel.full_state_dict())
    return out


def _reference():
    return adam_reference(*_build(), 2 * STEPS, LR)


@pytest.mark.slow
def test_dcp_checkpoint_resumes_under_other_plans(tmp_path):
    model, inputs = _build()
    plans = {}
    for name, (mesh, roles, zero) in PLANS.items():
        plan = autopar.plan(model, free_link_cpu(4), inputs, mesh_shape=mesh, axis_roles=roles)
        if zero:
            plan = dataclasses.replace(plan, trades=Trades(zero_stage=ZeroStage(zero), data_axes=(0,)))
        path = tmp_path / f"{name.replace(' ', '_')}.json"
        plan.save(path)
        plans[name] = str(path)
    ckpt = str(tmp_path / "ckpt")
    ref_losses, ref_state = _reference()
    results = run_on_ranks(_rank, 4, plans, ckpt, timeout_s=600)
    # every rank wrote its own pieces, none the whole model and its optimizer state
    files = [f for f in os.listdir(ckpt) if f.endswith(".distcp")]
    sizes = [os.path.getsize(os.path.join(ckpt, f)) for f in files]
    assert len(files) == 4 and max(sizes) < 0.6 * sum(sizes), sizes
    for rank, res in enumerate(results):
        assert res["names"] == sorted(ref_state), f"rank {rank}: state_dict() is not under the model's names"
        assert len(res["placements"]) == len(ref_state), "state_dict() holds tensors that are not DTensors"
        assert any(isinstance(p, Shard) for ps in res["placements"].values() for p in ps), res["placements"]
        assert res["export"] == (sorted(ref_state) if rank == 0 else []), f"rank {rank}: rank-0 export"
        first, then, _ = res[SAVER]
        assert first + then == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}: {SAVER} losses"
        for name in PLANS:
            _, losses, state = res[name]
            assert losses == pytest.approx(ref_losses[STEPS:], rel=1e-5), f"rank {rank}: {name} resumed"
            for k, v in ref_state.items():
                assert_adam_state_close(state[k], v, LR, 2 * STEPS, f"rank {rank}: {name}: {k}")
