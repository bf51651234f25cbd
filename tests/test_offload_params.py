"""Parameter offload (``Offload.PARAMETERS``: ZeRO-3 with FSDP2's ``CPUOffloadPolicy``, the blocks
streamed from host memory one ahead, ``codegen/zero.py``) as the search chooses, prices and runs it.

Compared against: the single-device model (losses and weights after two Adam steps on 2 gloo ranks,
with a memory limit 4x below the model's state per device as the memory model prices it, where the
search must choose the offload itself); the same plan without the offload (what the host holds
leaves the device, what the copies cost joins the step); the host link's own numbers (every byte of
the master shards crosses it up twice a step, in forward and backward, and its gradient down once);
and the host memory's size (short of what the offload keeps there: the typed error naming it).

On CPU ranks the host is the device: FSDP2 takes the policy there (its copies are CPU-to-CPU), so
the code path that runs is the one a GPU runs, which the test checks (policy and prefetch set).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from harness import adam_reference, assert_adam_state_close

import autopar
from autopar import AxisRole, Offload, Recompute, ZeroStage
from autopar.examples import llama, llama_tiny
from autopar.hardware import LinkSpec
from autopar.launch import run_on_ranks
from autopar.passes.dumps import size_text

CPU2 = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
DATA = dict(mesh_shape=(2,), axis_roles=(AxisRole.DATA,))
STEPS, LR = 2, 1e-2


def _build():
    # many small blocks: the parameters outweigh the activations, and a block is a small share
    return llama_tiny(batch=2, seq=8, layers=8, hidden=64, vocab=64)


def _state_bytes(plan) -> int:
    p = plan.predicted
    return p.param_bytes + p.grad_bytes + p.optimizer_bytes


@functools.cache
def _squeezed():
    """(the plan with no memory limit, the plan at a limit 4x below the former's state per device)."""
    model, inputs = _build()
    free = autopar.plan(model, CPU2, inputs, **DATA)
    limit = _state_bytes(free) / 4
    return free, autopar.plan(model, CPU2, inputs, memory_limit_bytes=limit, **DATA), limit


def _rank(rank: int, world: int, plan_path: str):
    model, inputs = _build()
    pmodel = autopar.autoparallelize(model, CPU2, inputs, plan=plan_path)
    opt = pmodel.optimizer(torch.optim.Adam, lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = pmodel(**inputs).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    groups = pmodel.zero.fsdp_modules
    offloaded = {
        p.offload_to_cpu
        for m in groups
        for g in m._get_fsdp_state()._fsdp_param_groups
        for p in g.fsdp_params
    }
    ahead = [
        ([id(s) for s in m._get_fsdp_state()._states_to_forward_prefetch],
         [id(s) for s in m._get_fsdp_state()._states_to_backward_prefetch])
        for m in groups
    ]  # fmt: skip
    states = [id(m._get_fsdp_state()) for m in groups]
    return losses, pmodel.full_state_dict(), offloaded, ahead, states


@pytest.mark.slow
def test_short_of_memory_the_search_offloads_the_parameters_and_trains_as_one_device(tmp_path):
    free, plan, limit = _squeezed()
    assert free.trades.offload is Offload.NONE
    assert plan.trades.offload is Offload.PARAMETERS and plan.trades.zero_stage is ZeroStage.PARAMETERS, (
        plan.trades
    )
    assert plan.predicted.peak_memory_bytes <= CPU2.memory_limit(limit)
    assert "parameters offloaded to host" in plan.summary()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert autopar.Plan.load(path).trades == plan.trades
    ref_losses, ref_state = adam_reference(*_build(), STEPS, LR)
    for rank, (losses, state, offloaded, ahead, states) in enumerate(
        run_on_ranks(_rank, 2, str(path), timeout_s=600)
    ):
        where = f"rank {rank}"
        assert offloaded == {True}, f"{where}: FSDP2's parameters not all under CPUOffloadPolicy"
        blocks = states[:-1]  # the root's group last
        assert len(blocks) == 8
        for i, (fwd, bwd) in enumerate(ahead[:-1]):  # one block ahead, each way
            assert fwd == blocks[i + 1 : i + 2] and bwd == blocks[max(i - 1, 0) : i], f"{where}: block {i}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
        assert set(state) == set(ref_state), f"{where}: state names differ"
        for k, want in ref_state.items():
            assert_adam_state_close(state[k], want, LR, STEPS, f"{where}: {k} after {STEPS} steps")


@functools.cache
def _zero3_and_offloaded(host_link: LinkSpec | None = None):
    """ZeRO-3's plan of the model, and the same decisions with the parameters offloaded, both
    repriced on the cluster (with ``host_link`` where given)."""
    model, inputs = _build()
    zero3 = autopar.plan(
        model, CPU2, inputs, zero_stage=3, offload=Offload.NONE, recompute=Recompute.NONE, micro_batches=1,
        **DATA,
    )  # fmt: skip
    cluster = CPU2 if host_link is None else dataclasses.replace(CPU2, host_link=host_link)
    offloaded = dataclasses.replace(
        zero3, trades=dataclasses.replace(zero3.trades, offload=Offload.PARAMETERS)
    )
    return autopar.reprice(model, cluster, inputs, zero3), autopar.reprice(model, cluster, inputs, offloaded)


def test_the_host_holds_what_leaves_the_device_and_the_copies_join_the_step():
    zero3, off = _zero3_and_offloaded()
    assert [d.output for d in off.decisions] == [d.output for d in zero3.decisions]
    host = off.trade_costs["offload"]["bytes_saved"]
    # the master shards, their gradients and Adam's state: ZeRO-3's on the device, all on the host
    assert host == pytest.approx(_state_bytes(zero3), rel=1e-6)
    assert _state_bytes(off) == 0
    # the peak loses all of it that lives there: the shards and the state throughout, the
    # gradients only from backward on
    drop = zero3.predicted.peak_memory_bytes - off.predicted.peak_memory_bytes
    p = zero3.predicted
    assert p.param_bytes + p.optimizer_bytes - 1 <= drop <= host + 1
    # the step: the device's optimizer step leaves the tables, the priced copies and host step join
    device_step = zero3.predicted.compute_s - off.predicted.compute_s
    assert device_step > 0
    added = off.predicted.step_time_s - zero3.predicted.step_time_s
    assert added == pytest.approx(off.trade_costs["offload"]["seconds"] - device_step, rel=1e-9, abs=1e-12)


def test_the_copies_are_priced_on_the_host_link():
    """On a host link so slow that no compute hides a copy: the shards go up twice a step (the
    forward's and the backward's gathers), their gradients down once, at the link's bandwidth."""
    bandwidth = 1e3
    _, off = _zero3_and_offloaded(LinkSpec(bandwidth=bandwidth, latency=1e-6))
    host = off.trade_costs["offload"]["bytes_saved"]
    shards = host / (autopar.Optimizer.ADAM.value + 2)  # the host holds masters, gradients, 2 moments
    assert off.trade_costs["offload"]["seconds"] == pytest.approx(3 * shards / bandwidth, rel=1e-3)


def test_forced_offload_with_too_little_host_memory_names_it():
    model, inputs = _build()
    _, off = _zero3_and_offloaded()
    need = off.trade_costs["offload"]["bytes_saved"]
    short = dataclasses.replace(CPU2, host_memory_bytes=int(need))  # a node of 2 devices: half each
    with pytest.raises(autopar.NoPlanFitsError) as err:
        autopar.plan(model, short, inputs, zero_stage=3, offload=Offload.PARAMETERS, **DATA)
    msg = str(err.value)
    assert "to host memory" in msg and "host_memory_bytes" in msg, msg
    assert size_text(need) in msg, msg


def test_parameter_offload_adds_to_zero3_what_it_added_on_an_h200():
    """What parameter offload adds to ZeRO-3's step on one H200, against what it added there
    (``benchmarks/bench_gpu_trades.py --size medium``, a bf16 Llama of 24 x 1024, 2026-11-26:
    ZeRO-3 226.8 ms, ZeRO-3 with every parameter, gradient and Adam's state in pinned host memory
    325.0 ms, +98.2 ms: the host's Adam and the shards' copies up and down over PCIe)."""
    with torch.device("meta"):
        model, inputs = llama(
            layers=24, hidden=1024, ffn=2688, heads=16, kv_heads=4, vocab=50304, batch=8, seq=1024
        )
    h200 = autopar.ClusterSpec.preset("h200", devices_per_node=1)
    step = {
        o: autopar.plan(
            model, h200, inputs, recompute=Recompute.NONE, micro_batches=1, zero_stage=3, offload=o
        ).predicted.step_time_s
        for o in (Offload.NONE, Offload.PARAMETERS)
    }
    added = step[Offload.PARAMETERS] - step[Offload.NONE]
    assert 98.2e-3 * 0.7 <= added <= 98.2e-3 * 1.3, added
