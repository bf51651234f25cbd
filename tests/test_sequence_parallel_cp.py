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

import os

import pytest
import torch
from harness import (
    D,
    S,
    T,
    adam_reference,
    assert_rank_as_reference,
    kept_bytes,
    parallel_axes,
    plan_and_train,
    ring_scatter_cpu,
    saved_bytes,
)  # fmt: skip

import autopar
from autopar import Recompute
from autopar.examples import llama_tiny
from autopar.launch import run_on_ranks
from autopar.options import Optimizer
from autopar.passes.analyze import analyze
from autopar.passes.costs import build_costs
from autopar.passes.fuse import fuse
from autopar.passes.replay import table_indices
from autopar.passes.strategies import build_strategies, nest_axes, nested
from autopar.passes.trace import trace
from autopar.placement import spec_from_str

LR, EPS, STEPS = 1e-2, 1e-5, 2
SEQ, HIDDEN = 128, 32
SQUEEZE = 0.6  # of the unconstrained plan's peak: the residual stream must shrink by the whole mesh
LAYOUT = dict(mesh_shape=(2, 2), axis_roles=(S, T), recompute=Recompute.NONE, zero_stage=0, micro_batches=1)


def build(name):
    layers = {"llama": 2, "llama1": 1}[name]
    return llama_tiny(batch=1, seq=SEQ, hidden=HIDDEN, vocab=128, layers=layers)


def _squeezed(name: str, cluster) -> autopar.Plan:
    """``name`` planned under ``SQUEEZE`` times its unconstrained plan's peak."""
    model, inputs = build(name)
    free = autopar.plan(model, cluster, inputs, **LAYOUT)
    limit = SQUEEZE * free.predicted.peak_memory_bytes / (1 - cluster.memory_reserve)
    return autopar.plan(model, cluster, inputs, memory_limit_bytes=limit, **LAYOUT)


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
    # a ring's reduce-scatter, which sequence parallelism runs into each norm (gloo's, priced as the
    # all-reduce it runs, makes the search keep the sequence whole on the tensor axis)
    cluster = ring_scatter_cpu(4)
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


def _tables_kept(name: str, plan, cluster) -> float:
    """Bytes the cost tables keep for backward on one device under ``plan``'s strategies: nodes,
    edges (a consumer's resharded copy: the all-gathered sequence a column-parallel linear keeps),
    and each storage several consumers keep, once (as ``tests/test_kept_activations.py``)."""
    model, inputs = build(name)
    tg = trace(model, inputs)
    fuse(tg, {u.kernel for u in plan.kernels})
    infos = analyze(tg)
    mesh, roles = tuple(plan.mesh_shape), LAYOUT["axis_roles"]
    tables = build_costs(
        tg, infos, build_strategies(tg, infos, mesh, roles), cluster, mesh, Optimizer.ADAM, roles
    )
    choice = table_indices(tables, plan)
    return kept_bytes(tables, infos, choice)


def _saved_rank(rank, world, paths):
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    out = {}
    for name, path in paths:
        model, inputs = build(name)
        out[name] = saved_bytes(autopar.autoparallelize(model, cluster, inputs, plan=path), inputs)
    return out


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("AUTOPAR_OPEN_GAPS"),
    reason="an open gap (issue 42), about 140 s: run with AUTOPAR_OPEN_GAPS=1",
)
@pytest.mark.xfail(
    strict=True,
    reason="open: the tables keep 116,224 bytes a layer on each rank, autograd saves 119,808 (3,584 "
    "more) under this fp32 sequence-parallel plan; not yet told apart from the tables' fp32 "
    "accounting without sequence parallelism (tests/test_kept_activations.py checks bf16)",
)
def test_a_sequence_parallel_layers_kept_bytes_are_what_autograd_saves(tmp_path):
    """Per layer (two layers less one: the embedding and the loss cancel), what the tables keep
    under the squeezed plans against the bytes autograd saves in each rank's forward."""
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=4)
    plans, paths = {}, []
    for name in ("llama1", "llama"):
        plans[name] = _squeezed(name, cluster)
        path = tmp_path / f"{name}.json"
        plans[name].save(path)
        paths.append((name, str(path)))
    both = spec_from_str("S(1),S(1)")
    assert all(spec_from_str(d.output) == both for d in _residual_adds(plans["llama"]))
    per_layer = _tables_kept("llama", plans["llama"], cluster) - _tables_kept(
        "llama1", plans["llama1"], cluster
    )
    for got in run_on_ranks(_saved_rank, 4, paths, timeout_s=600):
        measured = got["llama"] - got["llama1"]
        assert per_layer == measured, (per_layer, measured)


def test_every_reshard_on_three_axes_ends_where_it_should():
    """Every placement of a 3-D tensor to every other on a (2, 2, 2) mesh: the steps end at the
    target, with no shard sliced out of order (a dim several axes split is cut outer axis first,
    gathered inner axis first). (R, R, S(1)) -> (S(0), S(1), S(1)), the sequence nested on the
    last two axes of a (data, sequence, tensor) mesh, once re-cut axis 0 for ever."""
    import itertools

    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    from autopar.reshard import StepKind, reshard_plan

    opts = [Replicate(), Shard(0), Shard(1), Shard(2), Partial()]
    moves = {
        StepKind.ALL_GATHER: Replicate(),
        StepKind.ALL_REDUCE: Replicate(),
        StepKind.TO_PARTIAL: Partial(),
    }
    for src, dst in itertools.product(itertools.product(opts, repeat=3), repeat=2):
        if any(isinstance(p, Partial) for p in src) and any(isinstance(p, Partial) for p in dst):
            continue  # a partial sum kept partial on another axis: not a reshard anything asks for
        cur = list(src)
        for step in reshard_plan(src, dst, (2, 2, 2), 1.0).steps:
            if step.kind is StepKind.F:
                continue
            if step.kind in (StepKind.CHUNK, StepKind.REDUCE_SCATTER):
                # an axis after this one holds the dim already: its piece would be cut, not the tensor
                assert not any(isinstance(q, Shard) and q.dim == step.dim for q in cur[step.axis + 1 :]), (
                    src,
                    dst,
                )
                cur[step.axis] = Shard(step.dim)
            else:
                if step.kind is StepKind.ALL_GATHER:  # inner axes holding the dim are gathered first
                    dim = cur[step.axis].dim
                    assert not any(isinstance(q, Shard) and q.dim == dim for q in cur[step.axis + 1 :]), (
                        src,
                        dst,
                    )
                cur[step.axis] = moves[step.kind]
        assert tuple(cur) == dst, (src, dst, cur)
