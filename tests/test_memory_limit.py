"""The plan's memory limit is respected by what runs: plan for a device too small for the
unconstrained plan, run it on gloo ranks, and measure every rank's peak live tensor bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.cost_model.measure import peak_step_memory
from autopar.demo import train_step
from autopar.launch import run_on_ranks
from autopar.model_spec import load_model_spec

pytestmark = pytest.mark.slow

SPEC = "autopar.examples:gpt2_tiny(batch=8, seq=64, hidden=128, vocab=512)"


def _rank(rank: int, world: int, cluster_dict: dict, plan_path: str) -> int:
    torch.manual_seed(0)
    model, inputs = load_model_spec(SPEC)
    pmodel = autopar.autoparallelize(
        model, autopar.ClusterSpec.from_dict(cluster_dict), inputs, plan=plan_path
    )
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.01)
    train_step(pmodel, opt, inputs)  # gradients exist from here on, as in training
    peak = peak_step_memory(pmodel, lambda: train_step(pmodel, opt, inputs))
    dist.barrier()
    return peak


def test_a_plan_for_a_device_too_small_for_the_unconstrained_plan_runs_within_its_memory(tmp_path):
    """The device's memory is set so that the plan may use (MEMORY_FRACTION of it) 90% of what the
    unconstrained plan needs. What runs must fit the device: the 10% reserve absorbs the memory
    model's error (within 2% here) and, on GPUs, fragmentation."""
    import dataclasses

    from autopar.api import MEMORY_FRACTION

    base = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    model, inputs = load_model_spec(SPEC)
    free = autopar.plan(model, base, inputs, optimizer=autopar.Optimizer.SGD)
    device_bytes = int(0.9 * free.predicted.peak_memory_bytes / MEMORY_FRACTION)
    cluster = base.with_overrides(device=dataclasses.replace(base.device, memory_bytes=device_bytes))
    plan = autopar.plan(model, cluster, inputs, optimizer=autopar.Optimizer.SGD)
    assert (
        plan.predicted.peak_memory_bytes <= MEMORY_FRACTION * device_bytes < free.predicted.peak_memory_bytes
    )
    assert plan.decisions != free.decisions
    path = tmp_path / "plan.json"
    plan.save(path)
    peaks = run_on_ranks(_rank, 2, cluster.to_dict(), str(path))
    assert max(peaks) <= device_bytes, (max(peaks), device_bytes, plan.predicted.peak_memory_bytes)
