"""Sequence parallelism inside context parallelism: the residual stream split on a sequence axis
and, nested inside it, on the tensor axis (Megatron's SP under CP; ``passes/strategies.py:nest_axes``).

On gloo world 4, mesh (2, 2) with axis roles (SEQUENCE, TENSOR), a tiny Llama is planned under a
memory limit (a share of its unconstrained plan's peak, no recomputation, no ZeRO) that makes the
solver keep its residual stream as small as it can: split on the sequence over both axes, the
sequence axis outer. The plan must say so, and each rank's losses of two Adam steps and the full
state after them equal the single-device model's. Unit tests: which axes nest under which roles,
and that a data x tensor mesh offers no nested split at all.
"""

from __future__ import annotations

import pytest
import torch
from harness import D, S, T, adam_reference, assert_rank_as_reference, parallel_axes, plan_and_train

import autopar
from autopar import Recompute
from autopar.examples import llama_tiny
from autopar.passes.analyze import analyze
from autopar.passes.strategies import build_strategies, nest_axes, nested
from autopar.passes.trace import trace
from autopar.placement import spec_from_str

LR, EPS, STEPS = 1e-2, 1e-5, 2
SEQ, HIDDEN = 128, 32
SQUEEZE = 0.6  # of the unconstrained plan's peak: the residual stream must shrink by the whole mesh
LAYOUT = dict(mesh_shape=(2, 2), axis_roles=(S, T), recompute=Recompute.NONE, zero_stage=0, micro_batches=1)


def build(name):
    assert name == "llama"
    return llama_tiny(batch=1, seq=SEQ, hidden=HIDDEN, vocab=128)


def _residual_adds(plan) -> list:
    """The residual stream's adds: (batch, sequence, hidden) sums."""
    return [d for d in plan.decisions if d.op == "aten.add.Tensor" and tuple(d.shape) == (1, SEQ, HIDDEN)]


def test_nest_groups_follow_the_roles():
    assert nest_axes((2, 2), (S, T)) == ((0, 1),)
    assert nest_axes((2, 4, 2), (D, S, T)) == ((1, 2),)
    assert nest_axes((2, 2), (T, S)) == ()  # the tensor axis would be the outer one
    assert nest_axes((2, 2), (D, T)) == ()
    assert nest_axes((1, 2), (S, T)) == ()  # an axis of one rank splits nothing
    assert nest_axes((2, 2, 2), (D, autopar.AxisRole.EXPERT, T)) == ((0, 1),)


def _strategies(mesh, roles):
    model, inputs = llama_tiny(batch=4, seq=16, hidden=32, vocab=128)
    tg = trace(model, inputs)
    return build_strategies(tg, analyze(tg), mesh, roles)


def test_data_by_tensor_offers_no_nested_split_and_sequence_by_tensor_does():
    for mesh, roles in (((2, 2), (D, T)), ((2, 2), (T, S))):
        strats = _strategies(mesh, roles)
        bad = [(n, s) for n, ns in strats.items() for s in ns.strategies if nested(s, mesh)]
        assert not bad, (roles, bad[:3])
    strats = _strategies((2, 2), (S, T))
    sp = [
        n
        for n, ns in strats.items()
        if ns.node.target is torch.ops.aten.add.Tensor
        and any(s.out == (torch.distributed.tensor.Shard(1),) * 2 for s in ns.strategies)
    ]
    assert sp  # the residual adds may take the sequence split on both axes
    # attention's algorithms over the sequence axis never see a nested split
    for ns in strats.values():
        for s in ns.strategies:
            if s.via and any(s.via) and nested(s, (2, 2)):
                raise AssertionError(f"{ns.node.name}: {s}")


@pytest.mark.slow
def test_sequence_parallel_inside_context_parallel_trains_as_one_device(tmp_path):
    model, inputs = build("llama")
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=4)
    free = autopar.plan(model, cluster, inputs, **LAYOUT)
    limit = SQUEEZE * free.predicted.peak_memory_bytes / (1 - cluster.memory_reserve)
    key = ("llama", "sp-in-cp")
    plans, per_rank = plan_and_train(
        4, build, cluster, {key: dict(LAYOUT, memory_limit_bytes=limit)}, tmp_path, STEPS, LR, EPS
    )
    plan = plans[key]
    assert not isinstance(plan, str), f"planning failed:\n{plan}"
    adds = _residual_adds(plan)
    assert len(adds) == 4, [d.name for d in adds]  # two layers, two residual adds each
    both = spec_from_str("S(1),S(1)")
    assert all(spec_from_str(d.output) == both for d in adds), [(d.name, d.output) for d in adds]
    assert plan.predicted.peak_memory_bytes <= limit * (1 - cluster.memory_reserve) * (1 + 1e-9)
    ref = adam_reference(*build("llama"), STEPS, LR, EPS)
    for rank, results in enumerate(per_rank):
        code, axes = assert_rank_as_reference(rank, results[key], ref, LR, STEPS)
        assert axes >= parallel_axes((2, 2))
        if rank == 0:
            # the tensor axis gathers the sequence before a column-parallel linear, and
            # reduce-scatters it after a row-parallel one
            assert "all_gather(" in code and "reduce_scatter(" in code, code
