"""Waiting for the slowest rank (cost_model/sync.py): gaps partition a step's compute on the
cycle of back-to-back steps, the wait grows as the square root of a gap, plans add it."""

from __future__ import annotations

import math

import pytest
from fake_clock import FakeClock
from hypothesis import given
from hypothesis import strategies as st

import autopar
import autopar.examples
from autopar.cluster import ClusterSpec
from autopar.cost_model.comm import CommModel
from autopar.cost_model.sync import (
    FORWARD_SHARE,
    REFERENCE_GAP_S,
    SyncNode,
    sync_points,
    sync_wait_s,
    wait_for_gap,
)
from autopar.plan import PlannedCollective, Site
from autopar.reshard import Collective, Phase

# per node: compute, and whether it synchronizes before its forward, inside it, after its backward
nodes_st = st.lists(
    st.tuples(st.floats(0, 1e-2), st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=30
)  # fmt: skip


def _gaps_on_the_cycle(nodes, outputs, buckets):
    """Independently: lay one step's events on a time line (forward in order, a node's input
    collectives before its forward, its lowering's after; the outputs' when forward ends;
    backward in reverse, a node's gradient collectives after its backward; the buckets' when
    backward ends), then the gaps are the distances between consecutive synchronizing points on
    the cycle of back-to-back steps."""
    t, points = 0.0, []
    for c, before, inside, _ in nodes:
        if before:
            points.append(t)
        t += c * FORWARD_SHARE
        if inside:
            points.append(t)
    if outputs:
        points.append(t)
    for c, _, _, after in reversed(nodes):
        t += c * (1 - FORWARD_SHARE)
        if after:
            points.append(t)
    if buckets:
        points.append(t)
    return sorted([b - a for a, b in zip(points, points[1:])] + [points[0] + t - points[-1]])


@given(nodes_st, st.booleans(), st.booleans())
def test_gaps_partition_the_step_between_its_synchronizing_points(nodes, outputs, buckets):
    # each kind of point its own c, to see each point keep its collective's
    sync = [SyncNode(t, 1.0 if b else None, 2.0 if i else None, 3.0 if a else None) for t, b, i, a in nodes]
    points = sync_points(sync, 4.0 if outputs else None, 5.0 if buckets else None)
    if not (outputs or buckets or any(b or i or a for _, b, i, a in nodes)):
        assert points == []
        return
    gaps = [g for g, _ in points]
    total = sum(n[0] for n in nodes)
    assert sum(gaps) == pytest.approx(total, abs=1e-12)
    assert sorted(gaps) == pytest.approx(_gaps_on_the_cycle(nodes, outputs, buckets), abs=1e-12)
    # in step order: each node's forward points, the outputs', the backward's, the buckets'
    forward = [c for _, b, i, _ in nodes for c, on in ((1.0, b), (2.0, i)) if on]
    backward = [3.0 for *_, a in reversed(nodes) if a]
    expect = forward + [4.0] * outputs + backward + [5.0] * buckets
    assert [c for _, c in points] == expect


@given(gap=st.floats(0, 1.0), c=st.floats(0, 0.2))
def test_wait_grows_as_the_square_root_of_the_compute_since_the_last_collective(gap, c):
    w = wait_for_gap(gap, c)
    assert w == pytest.approx(c * max(0.0, math.sqrt(gap) - math.sqrt(REFERENCE_GAP_S)))
    assert wait_for_gap(gap * 4 + REFERENCE_GAP_S, c) >= w
    assert wait_for_gap(REFERENCE_GAP_S, c) == 0.0  # what the calibrated collectives already hold


def test_nothing_synchronizes_nothing_waits():
    assert sync_wait_s([SyncNode(1e-3)] * 5) == 0.0
    assert sync_wait_s([SyncNode(1e-3, inputs=0.0)] * 5) == 0.0
    # a point whose collective does not wait still ends the gap before the next one
    assert sync_wait_s([SyncNode(1e-2, inputs=0.0), SyncNode(1e-2, inputs=0.05)]) == pytest.approx(
        wait_for_gap(1e-2 * FORWARD_SHARE, 0.05)
    )


def test_a_plan_adds_the_wait_of_its_own_collectives():
    """The same plan on a device that drifts and on one that does not: the predicted steps differ
    by the wait of the plan's synchronizing points, each at its own collective's ``c`` (a kind
    measured, or ``sync_wait``); a tensor-parallel plan waits, one rank does not."""
    model, inputs = autopar.examples.mlp(batch=64, hidden=512, ffn=2048)  # gaps of ms
    base = ClusterSpec.preset("cpu", devices_per_node=2)
    kinds = {"all_reduce": 0.12}
    drifting = base.with_overrides(device=base.device.with_contention(sync_wait=0.05, sync_wait_kinds=kinds))
    roles = (autopar.AxisRole.TENSOR,)
    still = autopar.plan(model, base, inputs, axis_roles=roles)
    moving = autopar.plan(model, drifting, inputs, axis_roles=roles)
    assert any(c.kind is Collective.ALL_REDUCE for d in moving.decisions for c in d.collectives)

    def c_of(calls):
        return max((kinds.get(c.kind.value, 0.05) for c in calls), default=None)

    def points(decisions):
        assert all(c.site is Site.INPUTS for d in decisions for c in d.collectives)
        return [
            SyncNode(
                d.compute_s,
                inputs=c_of([c for c in d.collectives if c.phase is Phase.FORWARD]),
                backward=c_of([c for c in d.collectives if c.phase is Phase.BACKWARD]),
            )
            for d in decisions
        ]

    wait = sync_wait_s(points(moving.decisions))
    assert wait > 0
    assert moving.predicted.step_time_s - still.predicted.step_time_s == pytest.approx(wait)
    # the all-reduces' own c: a wait apart from the one sync_wait alone prices
    flat = drifting.device.with_contention(sync_wait_kinds={})
    assert autopar.plan(
        model, base.with_overrides(device=flat), inputs, axis_roles=roles
    ).predicted.step_time_s < (moving.predicted.step_time_s)
    # ranks that share cores wait as well (sync.py), over gaps of their slowed compute
    shared = drifting.with_overrides(device=drifting.device.with_contention(host_cores=1))
    plain = base.with_overrides(device=base.device.with_contention(host_cores=1))
    shared_plan = autopar.plan(model, shared, inputs, axis_roles=roles)
    plain_plan = autopar.plan(model, plain, inputs, axis_roles=roles)
    shared_wait = sync_wait_s(points(shared_plan.decisions))
    assert shared_wait > wait  # the same points, twice the compute between them
    assert shared_plan.predicted.step_time_s - plain_plan.predicted.step_time_s == pytest.approx(shared_wait)
    one = autopar.plan(model, drifting.with_overrides(devices_per_node=1), inputs)
    alone = autopar.plan(model, base.with_overrides(devices_per_node=1), inputs)
    assert one.predicted.step_time_s == pytest.approx(alone.predicted.step_time_s)


def test_a_data_parallel_step_waits_at_its_gradient_buckets_not_at_its_loss():
    """Data parallelism lists no collective on any node, and its step waits at the gradient
    buckets' all-reduces when backward ends, after the backward's share of the compute (the
    forward's end is a sync point still: the MLP's other output, its prediction, is gathered whole
    there, a kind that drifts by nothing here). The loss (a mean over the split batch) is
    all-reduced too, but off the step's path: started where the forward computes it and waited for
    where the caller reads it (``codegen/module.py:defer_output_sums``), so it adds no wait when
    forward ends, where it used to add the all-reduce's."""
    model, inputs = autopar.examples.mlp(batch=64, hidden=512, ffn=2048)
    base = ClusterSpec.preset("cpu", devices_per_node=2)
    drifting = base.with_overrides(device=base.device.with_contention(sync_wait_kinds={"all_reduce": 0.1}))
    roles = (autopar.AxisRole.DATA,)
    still = autopar.plan(model, base, inputs, axis_roles=roles)
    moving = autopar.plan(model, drifting, inputs, axis_roles=roles)
    listed = [n for d in moving.decisions for n in d.collectives]
    assert listed and all(c.site is Site.BUCKET for c in listed)  # only the buckets' members
    total = sum(d.compute_s for d in moving.decisions)
    expect = wait_for_gap(total * (1 - FORWARD_SHARE), 0.1)
    assert expect > 0
    assert moving.predicted.step_time_s - still.predicted.step_time_s == pytest.approx(expect)


def test_a_split_cross_entropy_lists_its_all_reduce_as_communication(monkeypatch):
    """The all-reduce a split mean cross-entropy runs inside its lowering is listed on the node and
    priced as its communication, not its compute; the step's total is the same either way. A loss
    the graph only returns runs it off the step's path (``LoweringCall.deferred``): listed, priced
    at nothing; with that deferral taken out, at the comm model's all-reduce."""
    model, inputs = autopar.examples.gpt2_tiny()
    cluster = ClusterSpec.preset("cpu", devices_per_node=2)
    plan = autopar.plan(model, cluster, inputs, axis_roles=(autopar.AxisRole.DATA,))
    (off,) = [d for d in plan.decisions if d.op == "aten.cross_entropy_loss.default"]
    assert off.collectives == (PlannedCollective(Collective.ALL_REDUCE, 0, 8, Phase.FORWARD, Site.INSIDE),)
    assert off.comm_s == 0.0
    import autopar.lowerings.loss as loss

    monkeypatch.setattr(loss, "returned_alone", lambda node, rows: False)
    plan = autopar.plan(model, cluster, inputs, axis_roles=(autopar.AxisRole.DATA,))
    (ce,) = [d for d in plan.decisions if d.op == "aten.cross_entropy_loss.default"]
    assert ce.collectives == off.collectives
    price = CommModel(cluster, plan.mesh_shape).time(Collective.ALL_REDUCE, 8, 0)
    assert ce.comm_s == pytest.approx(price)
    one = autopar.plan(model, cluster.with_overrides(devices_per_node=1), inputs)
    (alone,) = [d for d in one.decisions if d.op == "aten.cross_entropy_loss.default"]
    assert not alone.collectives and alone.comm_s == 0.0
    assert ce.compute_s < alone.compute_s  # half the batch, and no collective in it


def test_calibration_measures_what_each_kind_of_collective_adds_to_a_loop_of_steps(monkeypatch):
    """``measure_sync_wait`` on one gloo rank, on a clock that moves only by the loops' compute
    (1e-5 s per op) and by two stand-in collectives, each of which takes ``c * sqrt(seconds since
    it last returned)`` (except the first of each loop, which follows whatever ran before the
    loop), with different ``c``, and one call of one of them stalled by a second: the loops'
    compute comes to each gap asked, each kind's points are what it adds to a loop of ``steps``
    (``c sqrt(d) (steps - 1) / steps``), its fitted ``sync_wait`` is ``c (steps - 1) / steps``,
    and the stalled loop does not move it. The same with real blocking waits is
    benchmarks/bench_timing_checks.py's."""
    import torch.distributed as dist

    from autopar.cost_model.sync import SYNC_GAPS_S
    from autopar.launch import free_port
    from autopar.tools import calibrate as cal

    clock = FakeClock()
    monkeypatch.setattr(cal, "time", clock.module())
    monkeypatch.setattr(cal._GapWork, "__call__", lambda self, ops: clock.advance(ops * 1e-5))
    cs, steps = {"slow": 0.24, "fast": 0.12}, 20

    def stand_in(c: float, stall_at: int = 0):
        last, calls = [0.0], [0]

        def run() -> None:
            calls[0] += 1
            if (calls[0] - 1) % steps:  # loops run `steps` calls each
                clock.advance(c * math.sqrt(clock() - last[0]))
            if calls[0] == stall_at:
                clock.advance(1.0)
            last[0] = clock()

        return run

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        got = cal.measure_sync_wait(
            repeats=5,
            steps=steps,
            collectives={"slow": stand_in(cs["slow"], stall_at=5 * steps + 3), "fast": stand_in(cs["fast"])},
        )
    finally:
        dist.destroy_process_group()
    for kind, c in cs.items():
        gaps = [d for d, _ in got["points"][kind]]
        assert gaps == pytest.approx(SYNC_GAPS_S, rel=1e-9)
        assert [cost for _, cost in got["points"][kind]] == pytest.approx(
            [c * math.sqrt(d) * (steps - 1) / steps for d in SYNC_GAPS_S], rel=1e-6
        )
        assert got["sync_wait"][kind] == pytest.approx(c * (steps - 1) / steps, rel=1e-6)
