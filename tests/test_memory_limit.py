"""The plan's memory limit is respected by what runs: plan for a device too small for the
unconstrained plan, run it on gloo ranks, and measure every rank's peak live tensor bytes. The
cluster's memory reserve applies to the device's memory and to an explicit limit alike."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.demo import train_step
from autopar.launch import run_on_ranks
from autopar.model_spec import load_model_spec
from autopar.tools.measure import peak_step_memory

SPEC = "autopar.examples:gpt2_tiny(batch=8, seq=64, hidden=128, vocab=512)"


def _rank(rank: int, world: int, cluster_dict: dict, plan_path: str) -> int:
    torch.manual_seed(0)
    model, inputs = load_model_spec(SPEC)
    pmodel = autopar.autoparallelize(
        model, autopar.ClusterSpec.from_dict(cluster_dict), inputs, plan=plan_path
    )
    opt = pmodel.optimizer(torch.optim.SGD, lr=0.01)
    train_step(pmodel, opt, inputs)  # gradients exist from here on, as in training
    peak = peak_step_memory(pmodel, lambda: train_step(pmodel, opt, inputs))
    dist.barrier()
    return peak


# one free search per mesh: without roles the search also tries each mesh data parallel, and that
# plan of this tiny model holds about the least any plan can, leaving no room for a tighter one
AUTO = (autopar.AxisRole.AUTO,)


def test_an_explicit_limit_keeps_the_reserve():
    """A limit passed as memory_limit_bytes is memory, like the device's: the plan stays under it
    less the reserve (the unconstrained plan's own peak as the limit must change the plan)."""
    base = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    model, inputs = load_model_spec(SPEC)
    free = autopar.plan(model, base, inputs, optimizer=autopar.Optimizer.SGD, axis_roles=AUTO)
    limit = free.predicted.peak_memory_bytes
    plan = autopar.plan(
        model, base, inputs, optimizer=autopar.Optimizer.SGD, axis_roles=AUTO, memory_limit_bytes=limit
    )
    assert plan.predicted.peak_memory_bytes <= (1 - base.memory_reserve) * limit
    loose = base.with_overrides(memory_reserve=0.0)  # no reserve: the free plan fits its own peak
    same = autopar.plan(
        model, loose, inputs, optimizer=autopar.Optimizer.SGD, axis_roles=AUTO, memory_limit_bytes=limit
    )
    # the free plan, or another as fast (exact folding leaves ties to the solver): nothing is lost
    assert same.predicted.step_time_s == pytest.approx(free.predicted.step_time_s, rel=1e-9)
    assert same.predicted.peak_memory_bytes <= limit


@pytest.mark.slow
def test_a_plan_for_a_device_too_small_for_the_unconstrained_plan_runs_within_its_memory(tmp_path):
    """The device's memory is set so that the plan may use (all but the reserve) 90% of what the
    unconstrained plan needs; the same memory given as memory_limit_bytes gives the same plan.
    What runs must fit the device: the 10% reserve absorbs the memory model's error (within 2%
    here) and, on GPUs, fragmentation."""
    base = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    model, inputs = load_model_spec(SPEC)
    free = autopar.plan(model, base, inputs, optimizer=autopar.Optimizer.SGD, axis_roles=AUTO)
    device_bytes = int(0.9 * free.predicted.peak_memory_bytes / (1 - base.memory_reserve))
    cluster = base.with_overrides(device=dataclasses.replace(base.device, memory_bytes=device_bytes))
    plan = autopar.plan(model, cluster, inputs, optimizer=autopar.Optimizer.SGD, axis_roles=AUTO)
    assert plan.predicted.peak_memory_bytes <= cluster.memory_limit() < free.predicted.peak_memory_bytes
    assert plan.decisions != free.decisions or plan.trades != free.trades  # placements or trades
    explicit = autopar.plan(
        model, base, inputs, optimizer=autopar.Optimizer.SGD, axis_roles=AUTO, memory_limit_bytes=device_bytes
    )
    assert explicit.decisions == plan.decisions
    path = tmp_path / "plan.json"
    plan.save(path)
    peaks = run_on_ranks(_rank, 2, cluster.to_dict(), str(path))
    assert max(peaks) <= device_bytes, (max(peaks), device_bytes, plan.predicted.peak_memory_bytes)
    # and the model predicted the run's peak within its 10% target
    assert abs(plan.predicted.peak_memory_bytes - max(peaks)) <= 0.10 * max(peaks)
