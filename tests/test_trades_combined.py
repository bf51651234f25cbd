"""The trades together, as a memory-bound run takes them: ZeRO-3 + full recomputation + micro-batches
(data parallel on 2 ranks) and tensor parallel x ZeRO-3 with selective recomputation and
micro-batches (2 x 2 on 4 ranks), against the single-device model: the losses, the first step's
full gradients and ``full_state_dict()`` after two Adam steps (fp32, tight), the global batch
run through ``pmodel.step`` (micro-batches) with the optimizer ``pmodel.optimizer`` makes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import D, T, assert_adam_state_close
from test_zero import FP32, LR, STEPS, _full_grads

import autopar
from autopar.examples import gpt2_tiny, llama_tiny, palm_tiny
from autopar.launch import run_on_ranks
from autopar.trades import Recompute, Trades, ZeroStage

MODELS = {
    "gpt2": lambda: gpt2_tiny(batch=8, seq=16, hidden=32, vocab=128),
    "llama": lambda: llama_tiny(batch=8, seq=16, hidden=32, vocab=128),
    "palm": lambda: palm_tiny(batch=8, seq=16, hidden=32, vocab=128),
}
# world -> (mesh, roles, trades, models)
CASES = {
    2: ((2,), (D,), Trades(Recompute.FULL, 2, zero_stage=ZeroStage.PARAMETERS, data_axes=(0,)), ("gpt2", "llama")),
    4: ((2, 2), (D, T), Trades(Recompute.SELECTIVE, 2, zero_stage=ZeroStage.PARAMETERS, data_axes=(0,)),
        ("gpt2", "palm")),
}  # fmt: skip


def _build(name):
    return MODELS[name]()


def _rank(rank, world, jobs):
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    out = {}
    for name, path in jobs:
        model, inputs = _build(name)
        pmodel = autopar.autoparallelize(model, cluster, inputs, plan=path)
        opt = pmodel.optimizer(torch.optim.Adam, lr=LR)
        losses, grads = [], {}
        for step in range(STEPS):
            losses.append(pmodel.step(**inputs).float())
            if step == 0:
                grads = _full_grads(pmodel)
            opt.step()
            opt.zero_grad()
        recompute = [
            getattr(m, "recompute", None) for n, m in pmodel.local.named_children() if n.startswith("block_")
        ]
        out[name] = (losses, grads, pmodel.full_state_dict(), len(pmodel.zero.fsdp_modules), recompute)
    return out


def _reference(name):
    model, inputs = _build(name)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = model(**inputs).loss
        loss.backward()
        losses.append(loss.detach())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_zero3_recompute_and_micro_batches_together_match_the_single_device_model(world, tmp_path):
    mesh, roles, trades, names = CASES[world]
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    jobs = []
    for name in names:
        model, inputs = _build(name)
        plan = autopar.plan(model, cluster, inputs, mesh_shape=mesh, axis_roles=roles)
        path = tmp_path / f"{name}.json"
        dataclasses.replace(plan, trades=trades).save(path)
        jobs.append((name, str(path)))
    per_rank = run_on_ranks(_rank, world, jobs, timeout_s=600)
    for name in names:
        ref_losses, ref_grads, ref_state = _reference(name)
        for rank, results in enumerate(per_rank):
            losses, grads, state, groups, recompute = results[name]
            where = f"{name} world {world} rank {rank}"
            assert groups == 3, f"{where}: {groups} FSDP2 groups (ZeRO-3: one per block and the root)"
            assert recompute == [trades.recompute] * 2, f"{where}: blocks recompute {recompute}"
            for step, (got, want) in enumerate(zip(losses, ref_losses)):
                torch.testing.assert_close(got, want, **FP32, msg=f"{where}: loss of step {step}")
            for k in ref_grads:
                torch.testing.assert_close(grads[k], ref_grads[k], **FP32, msg=f"{where}: gradient of {k}")
            assert set(state) == set(ref_state)
            for k in ref_state:
                label = f"{where}: {k} after {STEPS} steps"
                assert_adam_state_close(state[k], ref_state[k], LR, STEPS, label)
