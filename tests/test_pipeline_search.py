"""Pipeline stages in the search (``passes/pipeline.py``, ``passes/search.py``): the cut against a
brute force, the candidates, the search against the layouts it can be forced to, and
``autopar.reprice`` against the search's own price."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar import AxisRole, Schedule
from autopar.examples import gpt, gpt2_tiny
from autopar.passes.pipeline import cut, micro_batch_counts, rank_balanced_cut, stage_cluster, stage_counts
from autopar.trades import Pipeline, TradesError


def _bottleneck(costs, pro, epi, cuts):
    bounds = [0, *cuts, len(costs)]
    loads = [sum(costs[bounds[c] : bounds[c + 1]]) for c in range(len(bounds) - 1)]
    loads[0] += pro
    loads[-1] += epi
    return max(loads)


@settings(max_examples=150, deadline=None)
@given(
    costs=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=8),
    pro=st.floats(0.0, 10.0),
    epi=st.floats(0.0, 10.0),
    data=st.data(),
)
def test_cut_is_the_best_contiguous_split(costs, pro, epi, data):
    """The cut's slowest chunk equals the least any contiguous split into non-empty chunks has."""
    chunks = data.draw(st.integers(1, len(costs)))
    cuts = cut(costs, pro, epi, chunks)
    assert (
        len(cuts) == chunks - 1 and list(cuts) == sorted(set(cuts)) and all(0 < c < len(costs) for c in cuts)
    )
    best = min(
        _bottleneck(costs, pro, epi, c) for c in itertools.combinations(range(1, len(costs)), chunks - 1)
    )
    assert _bottleneck(costs, pro, epi, cuts) == pytest.approx(best, rel=1e-5)


@settings(max_examples=100, deadline=None)
@given(
    costs=st.lists(st.floats(0.01, 10.0), min_size=2, max_size=24),
    pro=st.floats(0.0, 30.0),
    epi=st.floats(0.0, 30.0),
    data=st.data(),
)
def test_rank_balanced_cut_is_a_cut(costs, pro, epi, data):
    """Any blocks, any head and embeddings: ``stages * v`` contiguous non-empty chunks."""
    stages = data.draw(st.integers(1, max(1, len(costs) // 2)))
    v = data.draw(st.integers(1, len(costs) // stages))
    cuts = rank_balanced_cut(costs, pro, epi, stages, v)
    assert (
        len(cuts) == stages * v - 1
        and list(cuts) == sorted(set(cuts))
        and all(0 < c < len(costs) for c in cuts)
    )


def _makespan(schedule, stages, v, k, costs, pro, epi, cuts):
    from autopar.cost_model.pipeline import schedule_figures

    b = [0, *cuts, len(costs)]
    t = [sum(costs[b[c] : b[c + 1]]) for c in range(len(b) - 1)]
    t[0] += pro
    t[-1] += epi
    return schedule_figures(schedule, stages, v, k, [x / 3 for x in t], [2 * x / 3 for x in t])[0]


def test_interleaving_halves_the_bubble_and_survives_a_head():
    """80 equal blocks on 8 stages, 32 micro-batches (the 70B-on-512 layout): 1F1B's bubble is
    (S - 1) / k of the work, 2 chunks per rank halve it (Narayanan et al. 2021, eq. 2). With a head
    on the last chunk, cutting for the slowest chunk alone fills the first chunks and leaves the
    rest one block each: the rank-balanced cut is faster, and with a head of 3 blocks' work
    interleaving stays faster than 1F1B; with one of 9 (the 70B's fp32 head) neither interleaved
    cut beats 1F1B, which the search then takes."""
    S, k, blocks = 8, 32, [1.0] * 80
    work = k * 80 / S
    one = _makespan(Schedule.ONE_F_ONE_B, S, 1, k, blocks, 0.0, 0.0, cut(blocks, 0.0, 0.0, S))
    two = _makespan(
        Schedule.INTERLEAVED_1F1B, S, 2, k, blocks, 0.0, 0.0, rank_balanced_cut(blocks, 0.0, 0.0, S, 2)
    )
    assert one / work - 1 == pytest.approx((S - 1) / k, rel=0.02)
    assert two / work - 1 == pytest.approx((S - 1) / (2 * k), rel=0.15)
    for head, wins in ((3.0, True), (9.0, False)):
        one = _makespan(Schedule.ONE_F_ONE_B, S, 1, k, blocks, 0.2, head, cut(blocks, 0.2, head, S))
        greedy = _makespan(
            Schedule.INTERLEAVED_1F1B, S, 2, k, blocks, 0.2, head, cut(blocks, 0.2, head, 2 * S)
        )
        balanced = _makespan(
            Schedule.INTERLEAVED_1F1B, S, 2, k, blocks, 0.2, head, rank_balanced_cut(blocks, 0.2, head, S, 2)
        )
        assert balanced < greedy
        assert (balanced < one) is wins


def test_candidates():
    opts = autopar.SearchOptions
    assert stage_counts(8, 4, opts()) == [2, 4]  # divisors of the world, at most the blocks
    assert stage_counts(8, 96, opts()) == [2, 4, 8]
    assert stage_counts(8, 96, opts(pipeline_stages=4)) == [4]
    assert stage_counts(8, 96, opts(pipeline_stages=1)) == []
    assert stage_counts(8, 96, opts(mesh_shape=(8,))) == []  # a whole-world mesh: no pipeline
    a100 = autopar.ClusterSpec.parse("a100-80gb:64x8")
    sub = stage_cluster(a100, 64)
    assert (sub.nodes, sub.devices_per_node) == (1, 8)
    sub = stage_cluster(a100, 4)
    assert (sub.nodes, sub.devices_per_node) == (16, 8)
    assert stage_cluster(autopar.ClusterSpec.parse("a100-80gb:3x8"), 8) is None  # 3 devices of a node
    # micro-batches: the batch's divisors whose micro-batches split over the data axis, >= stages
    assert micro_batch_counts(64, 1, 8, opts()) == [64, 32, 16, 8]
    assert micro_batch_counts(64, 8, 8, opts()) == [8]
    assert micro_batch_counts(6, 1, 8, opts()) == [6, 3, 2, 1]  # fewer than the stages: all there are
    assert micro_batch_counts(64, 1, 8, opts(micro_batches=4)) == [4]


def test_pipeline_refuses_what_torch_cannot_run():
    with pytest.raises(TradesError, match="virtual_stages must be >= 2"):
        Pipeline(2, Schedule.INTERLEAVED_1F1B, 1, (1,))
    with pytest.raises(TradesError, match="needs 3 cuts"):
        Pipeline(4, Schedule.ONE_F_ONE_B, 1, (1, 2))
    with pytest.raises(TradesError, match="at least as many repeated blocks"):
        Pipeline.even_cuts(2, 4)
    assert Pipeline.from_dict(Pipeline(2, "gpipe", 1, (3,)).to_dict()) == Pipeline(2, Schedule.GPIPE, 1, (3,))


@pytest.fixture(scope="module")
def mid():
    """A GPT-3-shaped model small enough to plan in seconds, on 16 A100s."""
    with torch.device("meta"):
        model, inputs = gpt(layers=8, hidden=1024, heads=16, vocab=8192, batch=32, seq=512)
    return model, inputs, autopar.ClusterSpec.parse("a100-80gb:2x8")


def test_search_is_no_slower_than_the_layouts_it_can_be_forced_to(mid):
    """The search's plan is at least as fast as each pipeline it can be forced to (its own
    candidates), and a forced pipeline is the one asked for."""
    model, inputs, cluster = mid
    kw = dict(outputs=autopar.Outputs.LOCAL)
    auto = autopar.plan(model, cluster, inputs, **kw)
    for stages, mesh, roles in [(2, (8,), (AxisRole.TENSOR,)), (4, (2, 2), (AxisRole.DATA, AxisRole.TENSOR))]:
        forced = autopar.plan(
            model, cluster, inputs, pipeline_stages=stages, mesh_shape=mesh, axis_roles=roles, **kw
        )
        assert forced.pipeline.stages == stages and tuple(forced.mesh_shape) == mesh
        assert forced.world_size == cluster.world_size
        assert auto.predicted.step_time_s <= forced.predicted.step_time_s * (1 + 1e-9)
    spmd = autopar.plan(model, cluster, inputs, pipeline_stages=1, **kw)
    assert not spmd.pipeline.enabled
    assert auto.predicted.step_time_s <= spmd.predicted.step_time_s * (1 + 1e-9)


def test_reprice_prices_a_pipeline_as_the_search_did(mid):
    model, inputs, cluster = mid
    plan = autopar.plan(
        model, cluster, inputs, outputs=autopar.Outputs.LOCAL, pipeline_stages=4, schedule="gpipe",
        mesh_shape=(4,), axis_roles=(AxisRole.TENSOR,), micro_batches=8,
    )  # fmt: skip
    again = autopar.reprice(model, cluster, inputs, plan)
    assert again.pipeline == plan.pipeline
    # within 0.1%: the search's tables are coarsened (passes/coarsen.py), and a class's total is
    # shared evenly among its members, wherever they run; repricing builds them per node (without
    # coarsening the two agree exactly). The step's total is the same, its split among chunks not quite
    assert again.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-3)
    assert again.predicted.peak_memory_bytes == pytest.approx(plan.predicted.peak_memory_bytes, rel=1e-9)
    # GPipe: (k + S - 1) micro-batch slots of the slowest chunk at least, the bubble included
    slowest = max(c["forward_s"] + c["backward_s"] for c in plan.stage_costs)
    assert plan.predicted.step_time_s >= (8 + 4 - 1) * slowest


def test_tiny_models_stay_unpipelined_on_cpu():
    """Where every op costs microseconds, each micro-batch's launches and the schedule's host time
    make a pipeline slower than keeping the model on each rank: the search says so."""
    model, inputs = gpt2_tiny()
    plan = autopar.plan(model, autopar.ClusterSpec.preset("cpu", devices_per_node=2), inputs)
    assert not plan.pipeline.enabled
    assert math.prod(plan.mesh_shape) == 2


@settings(max_examples=40, deadline=None)
@given(
    stages=st.integers(2, 4),
    schedule=st.sampled_from(list(Schedule)),
    extra=st.integers(1, 5),
    data=st.data(),
)
def test_long_schedules_extrapolate_exactly(stages, schedule, extra, data):
    """Past ``SIMULATED_MICRO_BATCHES``, the schedule's figures extended from two shorter
    simulations are the full simulation's (random chunk times, sends and bytes): the peaks exactly,
    the makespan within 1% (a send slower than its neighbours' can shift the steady state's phase
    by part of one action: e.g. 166.5 for 166.0 on 3 stages with one link at a quarter of an
    action)."""
    from autopar.cost_model.pipeline import simulate_schedule
    from autopar.passes import pipeline as pp

    v = 2 if schedule.multi_chunk else 1
    n = stages * v
    draw = lambda lo, hi: [data.draw(st.floats(lo, hi)) for _ in range(n)]  # noqa: E731
    fwd, bwd, act = draw(0.5, 2.0), draw(1.0, 4.0), draw(1.0, 10.0)
    p2p = draw(0.0, 0.3)[: n - 1]
    base = max(pp.SIMULATED_MICRO_BATCHES, 4 * stages * v)
    k = base + base % stages + stages * extra + stages  # past the simulated range, a multiple of S
    k += -k % stages
    got = pp.price_schedule(schedule, stages, v, k, fwd, bwd, p2p, act)
    want = simulate_schedule(schedule, stages, v, k, fwd, bwd, p2p, act)
    assert got.makespan == pytest.approx(want.makespan, rel=1e-2)
    assert got.busy == pytest.approx(want.busy, rel=1e-9)
    assert got.peak_bytes == pytest.approx(want.peak_bytes, rel=1e-9)
