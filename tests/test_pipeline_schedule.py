"""The pipeline-schedule simulator (cost_model/pipeline.py) against the published formulas, torch's
own schedule orders, and the invariants any list schedule obeys; and its timeline picture.

Durations are whole numbers where a formula is checked for equality, so float sums are exact.
"""

from __future__ import annotations

import types
import xml.etree.ElementTree as ET

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from autopar.cost_model.pipeline import (
    Action,
    Schedule,
    ScheduleError,
    Timeline,
    schedule_order,
    simulate,
    simulate_schedule,
)
from autopar.report.pipeline import timeline_svg

SVG = "{http://www.w3.org/2000/svg}"
FEW = settings(max_examples=40, deadline=None)
MULTI = (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE)


def _valid(schedule: Schedule, stages: int, k: int) -> bool:
    if schedule is Schedule.ONE_F_ONE_B:
        return k >= stages
    if schedule in MULTI:
        return k % max(1, k // stages) == 0
    return True


def _per_round(stages: int, k: int) -> int:
    return k // max(1, k // stages)


# -- published formulas ------------------------------------------------------------------------------
@FEW
@given(
    schedule=st.sampled_from([Schedule.GPIPE, Schedule.ONE_F_ONE_B]),
    stages=st.integers(1, 8),
    k=st.integers(1, 24),
    f=st.integers(1, 1000),
    b=st.integers(1, 1000),
)
def test_gpipe_1f1b_makespan_is_the_bubble_formula(schedule, stages, k, f, b):
    """(k + S - 1)(f + b) and bubble (S - 1)/(k + S - 1) (Huang et al. 2019; Narayanan et al. 2021)."""
    assume(_valid(schedule, stages, k))
    tl = simulate_schedule(schedule, stages, 1, k, [f] * stages, [b] * stages)
    assert tl.makespan == (k + stages - 1) * (f + b)
    assert tl.bubble_fraction == pytest.approx((stages - 1) / (k + stages - 1))
    assert tl.busy == tuple(float(k * (f + b)) for _ in range(stages))


@FEW
@given(stages=st.integers(1, 8), k=st.integers(1, 16), f=st.integers(1, 100), b=st.integers(1, 100))
def test_peak_in_flight_and_bytes(stages, k, f, b):
    """GPipe keeps every micro-batch's activations; 1F1B at most S - r on rank r (its warm-up + 1)."""
    act = [1000.0 * (r + 1) for r in range(stages)]
    gpipe = simulate_schedule(Schedule.GPIPE, stages, 1, k, [f] * stages, [b] * stages, act_bytes=act)
    assert gpipe.peak_in_flight == (k,) * stages
    assert gpipe.peak_bytes == tuple(k * a for a in act)
    if k >= stages:
        one = simulate_schedule(Schedule.ONE_F_ONE_B, stages, 1, k, [f] * stages, [b] * stages, act_bytes=act)
        assert one.peak_in_flight == tuple(min(stages - r, k) for r in range(stages))
        assert one.peak_bytes == tuple(min(stages - r, k) * act[r] for r in range(stages))


@FEW
@given(
    stages=st.integers(1, 8),
    virtual=st.integers(2, 4),
    rounds=st.integers(1, 3),
    a=st.integers(1, 100),
    c=st.integers(1, 100),
)
def test_interleaved_makespan_is_megatrons(stages, virtual, rounds, a, c):
    """Narayanan et al. 2021: v chunks of f/v, b/v per rank, k a multiple of S:
    makespan (k + (S-1)/v)(f + b), i.e. the bubble shrinks v-fold. f = v a, b = v c."""
    k = rounds * stages
    chunks = stages * virtual
    tl = simulate_schedule(Schedule.INTERLEAVED_1F1B, stages, virtual, k, [a] * chunks, [c] * chunks)
    assert tl.makespan == (k * virtual + stages - 1) * (a + c)  # = (k + (S-1)/v)(f + b)
    one = simulate_schedule(
        Schedule.ONE_F_ONE_B, stages, 1, k, [virtual * a] * stages, [virtual * c] * stages
    )
    assert tl.makespan <= one.makespan


@FEW
@given(
    stages=st.integers(1, 8),
    virtual=st.integers(2, 4),
    k=st.integers(1, 24),
    f=st.floats(0.01, 10),
    b=st.floats(0.01, 10),
    wf=st.floats(0.0, 1.0),
)
def test_interleaved_never_slower_than_1f1b_and_zero_bubble_never_slower_than_interleaved(
    stages, virtual, k, f, b, wf
):
    """Same total work per rank, uniform chunks: interleaving only shrinks the bubble (against
    1F1B's, or GPipe's formula where 1F1B refuses k < S), and zero bubble's deferred weight
    gradients only fill it. (With unbalanced ranks interleaving can lose: not a property.)"""
    assume(_valid(Schedule.INTERLEAVED_1F1B, stages, k))
    chunks = stages * virtual
    fc, bc = [f / virtual] * chunks, [b / virtual] * chunks
    inter = simulate_schedule(Schedule.INTERLEAVED_1F1B, stages, virtual, k, fc, bc)
    zb = simulate_schedule(Schedule.ZERO_BUBBLE, stages, virtual, k, fc, bc, wgrad_fraction=wf)
    baseline = (k + stages - 1) * (f + b)
    if k >= stages:
        baseline = simulate_schedule(Schedule.ONE_F_ONE_B, stages, 1, k, [f] * stages, [b] * stages).makespan
    assert inter.makespan <= baseline * (1 + 1e-9)
    assert zb.makespan <= inter.makespan * (1 + 1e-9)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5, 8])
def test_multi_chunk_peak_in_flight_is_the_warmup_plus_one(stages):
    """Interleaved 1F1B holds its warm-up forwards + 1, w = (v-1) p + 2 (S-1-r) (torch's
    _get_warmup_ops); zero bubble's warm-up is (v-1) p + (S-1-r) but rank r defers its W by r
    backwards, so every rank holds (v-1) p + S; both capped at all k v."""
    for virtual in (2, 3):
        for k in (1, 2, stages, stages + 1, 2 * stages, 12):
            if not _valid(Schedule.INTERLEAVED_1F1B, stages, k):
                continue
            p, n = _per_round(stages, k), k * virtual
            ones = [1.0] * (stages * virtual)
            inter = simulate_schedule(Schedule.INTERLEAVED_1F1B, stages, virtual, k, ones, ones)
            zb = simulate_schedule(Schedule.ZERO_BUBBLE, stages, virtual, k, ones, ones)
            for r in range(stages):
                assert inter.peak_in_flight[r] == min((virtual - 1) * p + 2 * (stages - 1 - r) + 1, n)
                assert zb.peak_in_flight[r] == min((virtual - 1) * p + stages, n)


@FEW
@given(
    stages=st.integers(1, 8),
    k=st.integers(1, 12),
    f=st.integers(1, 100),
    b=st.integers(1, 100),
    t=st.integers(0, 50),
)
def test_gpipe_with_p2p(stages, k, f, b, t):
    """Each hop adds t to the fill and t to the drain: (k + S - 1)(f + b) + 2 (S - 1) t (by hand:
    the last rank starts at (S-1)(f+t), the first micro-batch's gradient climbs back in (S-1)(b+t))."""
    tl = simulate_schedule(Schedule.GPIPE, stages, 1, k, [f] * stages, [b] * stages, p2p=[t] * (stages - 1))
    assert tl.makespan == (k + stages - 1) * (f + b) + 2 * (stages - 1) * t


# -- invariants of every order -----------------------------------------------------------------------
@st.composite
def _cases(draw):
    schedule = draw(st.sampled_from(list(Schedule)))
    stages = draw(st.integers(1, 8))
    virtual = draw(st.integers(2, 4)) if schedule in MULTI else 1
    k = draw(st.integers(1, 12))
    assume(_valid(schedule, stages, k))
    chunks = stages * virtual
    times = st.lists(st.floats(0.001, 5.0), min_size=chunks, max_size=chunks)
    fwd, bwd = draw(times), draw(times)
    p2p = draw(st.lists(st.floats(0.0, 1.0), min_size=chunks - 1, max_size=chunks - 1))
    act = draw(st.lists(st.floats(0.0, 1e9), min_size=chunks, max_size=chunks))
    return schedule, stages, virtual, k, fwd, bwd, p2p, act, draw(st.floats(0.0, 1.0))


@settings(max_examples=80, deadline=None)
@given(_cases())
def test_every_order_is_complete_and_every_timeline_consistent(case):
    schedule, stages, virtual, k, fwd, bwd, p2p, act, wf = case
    chunks = stages * virtual
    order = schedule_order(schedule, stages, virtual, k)
    assert sorted(order) == list(range(stages))
    split = schedule is Schedule.ZERO_BUBBLE
    want = sorted(["F", "I", "W"] if split else ["B", "F"])
    seen: dict[tuple[int, int], list[str]] = {}
    for r, acts in order.items():
        for a in acts:
            assert a.chunk % stages == r  # torch's looped placement
            seen.setdefault((a.chunk, a.micro), []).append(a.kind)
    assert set(seen) == {(c, m) for c in range(chunks) for m in range(k)}
    assert all(sorted(kinds) == want for kinds in seen.values())

    tl = simulate(order, fwd, bwd, p2p, act, wgrad_fraction=wf)
    assert len(tl.events) == sum(len(a) for a in order.values())
    end = {(e.action.kind, e.action.chunk, e.action.micro): e.end for e in tl.events}
    for r in range(stages):  # in the rank's order, one at a time
        mine = [e for e in tl.events if e.rank == r]
        assert [e.action for e in mine] == order[r]
        for e1, e2 in zip(mine, mine[1:]):
            assert e2.start >= e1.end
        assert tl.busy[r] == pytest.approx(sum(e.end - e.start for e in mine))
    grad = "I" if split else "B"
    eps = 1e-9

    def hop(c: int) -> float:  # chunk c -> c + 1: free on one rank (S = 1)
        return p2p[c] if c % stages != (c + 1) % stages else 0.0

    free = dict.fromkeys(range(stages), 0.0)
    for e in tl.events:  # by rank, in order
        c, m, kind = e.action.chunk, e.action.micro, e.action.kind
        dur = {"F": fwd[c], "B": bwd[c], "I": (1 - wf) * bwd[c], "W": wf * bwd[c]}[kind]
        assert e.end - e.start == pytest.approx(dur, abs=1e-12)
        ready = [free[e.rank]]  # each dependency holds, and the action waits for nothing else
        if kind == "F" and c > 0:
            ready.append(end[("F", c - 1, m)] + hop(c - 1))
        if kind in ("B", "I"):
            ready.append(end[("F", c, m)])
            if c < chunks - 1:
                ready.append(end[(grad, c + 1, m)] + hop(c))
        if kind == "W":
            ready.append(end[("I", c, m)])
        assert e.start == pytest.approx(max(ready), abs=eps)
        free[e.rank] = e.end
    assert tl.makespan == max(e.end for e in tl.events)
    assert 0.0 <= tl.bubble_fraction < 1.0
    assert all(1 <= n <= k * virtual for n in tl.peak_in_flight)
    # the peak is a running sum of adds and frees: rounding relative to the bytes (1e9 here and there)
    assert all(b_ <= n * max(act) * (1 + 1e-12) + 1e-6 for b_, n in zip(tl.peak_bytes, tl.peak_in_flight))


# -- torch's own orders ------------------------------------------------------------------------------
def _stand_in_stages(stages: int, virtual: int):
    """What the schedule constructors read of a stage (no process group, no module)."""
    return [
        types.SimpleNamespace(
            num_stages=stages * virtual, group_size=stages, group_rank=0, submod=None, stage_index=i * stages
        )
        for i in range(virtual)
    ]


def _compute_actions(pipeline_order) -> dict[int, list[Action]]:
    return {
        r: [
            Action(a.computation_type.value, a.stage_index, a.microbatch_index)
            for a in acts
            if a is not None and a.computation_type.value in ("F", "B", "I", "W")
        ]
        for r, acts in pipeline_order.items()
    }


def _torch_order(schedule: Schedule, stages: int, virtual: int, k: int):
    ts = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = {
        Schedule.GPIPE: ts.ScheduleGPipe,
        Schedule.ONE_F_ONE_B: ts.Schedule1F1B,
        Schedule.INTERLEAVED_1F1B: ts.ScheduleInterleaved1F1B,
        Schedule.ZERO_BUBBLE: getattr(ts, "ScheduleInterleavedZeroBubble", None),
    }[schedule]
    if cls is None:
        pytest.skip(f"this torch has no schedule class for {schedule.value}")
    stand_ins = _stand_in_stages(stages, virtual)
    sched = cls(stand_ins if schedule in MULTI else stand_ins[0], k)
    if getattr(sched, "pipeline_order", None) is None:
        pytest.skip(f"this torch's {cls.__name__} exposes no pipeline_order")
    return _compute_actions(sched.pipeline_order)


@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5, 8])
def test_orders_are_torchs(schedule, stages):
    """torch builds each schedule's pipeline_order in its constructor; ours is the same, action for
    action, and both refuse the same micro-batch counts. One exception: Schedule1F1B's
    pipeline_order for the last rank (no warm-up) skips F0 and names F(k) (an off-by-one in that
    IR, which torch only uses for visualisation); its _step_microbatches runs F0 B0 F1 B1 ..."""
    virtuals = (2, 3, 4) if schedule in MULTI else (1,)
    compared = 0
    for virtual in virtuals:
        for k in sorted(
            {1, 2, 3, stages - 1, stages, stages + 1, 2 * stages - 1, 2 * stages + 2, 3 * stages, 9, 12}
        ):
            if k < 1:
                continue
            try:
                mine = schedule_order(schedule, stages, virtual, k)
            except ScheduleError:
                with pytest.raises(ValueError):
                    _torch_order(schedule, stages, virtual, k)
                continue
            theirs = _torch_order(schedule, stages, virtual, k)
            assert sorted(theirs) == sorted(mine)
            for r in mine:
                if schedule is Schedule.ONE_F_ONE_B and r == stages - 1 and theirs[r] != mine[r]:
                    assert theirs[r] == [
                        a for m in range(k) for a in (Action("F", r, m + 1), Action("B", r, m))
                    ]
                    assert mine[r] == [a for m in range(k) for a in (Action("F", r, m), Action("B", r, m))]
                    continue
                assert mine[r] == theirs[r], f"{schedule.value} S={stages} v={virtual} k={k} rank {r}"
            compared += 1
    assert compared >= 3


# -- errors ------------------------------------------------------------------------------------------
def test_invalid_counts_say_what_to_change():
    with pytest.raises(ScheduleError, match="virtual must be >= 2"):
        schedule_order(Schedule.INTERLEAVED_1F1B, 4, 1, 8)
    with pytest.raises(ScheduleError, match="virtual must be 1.*interleaved_1f1b"):
        schedule_order(Schedule.ONE_F_ONE_B, 4, 2, 8)
    with pytest.raises(ScheduleError, match=r"use >= 4 micro-batches, or schedule gpipe"):
        schedule_order(Schedule.ONE_F_ONE_B, 4, 1, 3)
    with pytest.raises(ScheduleError, match=r"use 8 or 10") as e:
        schedule_order(Schedule.ZERO_BUBBLE, 4, 2, 9)
    assert isinstance(e.value, ValueError)
    with pytest.raises(ScheduleError, match="stages must be a positive integer"):
        schedule_order(Schedule.GPIPE, 0, 1, 4)
    with pytest.raises(ValueError):
        schedule_order("pipedream", 2, 1, 4)


def test_invalid_simulation_inputs_say_what_to_change():
    order = schedule_order(Schedule.GPIPE, 2, 1, 2)
    with pytest.raises(ScheduleError, match="bwd needs one value per chunk"):
        simulate(order, [1.0, 1.0], [1.0])
    with pytest.raises(ScheduleError, match=r"fwd\[1\] = -1.0"):
        simulate(order, [1.0, -1.0], [1.0, 1.0])
    with pytest.raises(ScheduleError, match="p2p needs one value per chunk"):
        simulate(order, [1.0, 1.0], [1.0, 1.0], p2p=[1.0, 1.0, 1.0])
    with pytest.raises(ScheduleError, match="wgrad_fraction"):
        simulate(order, [1.0, 1.0], [1.0, 1.0], wgrad_fraction=1.5)
    with pytest.raises(ScheduleError, match="chunk 1, micro-batch 1 has actions"):
        simulate({0: order[0], 1: order[1][:-1]}, [1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ScheduleError, match="names chunk 1, but fwd/bwd give times for chunks 0..0"):
        simulate(order, [1.0], [1.0])
    with pytest.raises(ScheduleError, match="fwd has 3 times"):
        simulate_schedule(Schedule.GPIPE, 2, 1, 2, [1.0] * 3, [1.0] * 3)


def test_deadlock_names_the_stuck_actions():
    """Rank 1 runs micro-batch 1 first; rank 0 will not send it before micro-batch 0's gradient."""
    order = {
        0: [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
        1: [Action("F", 1, 1), Action("B", 1, 1), Action("F", 1, 0), Action("B", 1, 0)],
    }
    with pytest.raises(ScheduleError, match="deadlocks") as e:
        simulate(order, [1.0, 1.0], [1.0, 1.0])
    msg = str(e.value)
    assert "rank 0 at 0B0 waits on 1B0 or 1I0" in msg and "rank 1 at 1F1 waits on 0F1" in msg
    with pytest.raises(ScheduleError, match="rank 0 at 0B0 waits on 0F0"):  # backward before its forward
        simulate({0: [Action("B", 0, 0), Action("F", 0, 0)]}, [1.0], [1.0])


# -- the picture -------------------------------------------------------------------------------------
def test_timeline_svg_parses_with_one_rect_per_event():
    tl = simulate_schedule(Schedule.ONE_F_ONE_B, 4, 1, 8, [1e-3] * 4, [2e-3] * 4, act_bytes=[2**20] * 4)
    svg = timeline_svg(tl, title="1F1B <4 stages>")
    root = ET.fromstring(svg)
    rects = list(root.iter(f"{SVG}rect"))
    assert len(rects) == len(tl.events) + 2  # + the legend's forward and backward
    tips = [t.text for t in root.iter(f"{SVG}title")]
    assert "F chunk 3, micro-batch 2, 9.00-10.00 ms" in tips  # rank 3: F0 at 3 ms, then B F every 3 ms
    texts = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert f"bubble {tl.bubble_fraction * 100:.1f}%" in texts
    assert "1F1B <4 stages>" in texts and "rank 3" in texts and "4 in flight" in texts
    empty = ET.fromstring(timeline_svg(Timeline((), 0.0, (), (), ())))
    assert not list(empty.iter(f"{SVG}rect")) and "no events" in empty.get("aria-label")


def test_timeline_svg_zero_bubble_with_chunk_labels():
    chunks = 2 * 2
    tl = simulate_schedule(Schedule.ZERO_BUBBLE, 2, 2, 4, [1e-3] * chunks, [2e-3] * chunks)
    labels = [
        f"blocks {2 * c}-{2 * c + 1} & <head>" if c == 3 else f"blocks {2 * c}-{2 * c + 1}" for c in range(4)
    ]
    root = ET.fromstring(timeline_svg(tl, chunk_labels=labels))
    assert len(list(root.iter(f"{SVG}rect"))) == len(tl.events) + 3  # forward, input grad, weight grad
    tips = [t.text for t in root.iter(f"{SVG}title")]
    assert any(t.startswith("W blocks 6-7 & <head>, micro-batch 0, ") for t in tips)


@settings(max_examples=60, deadline=None)
@given(
    stages=st.integers(1, 6),
    schedule=st.sampled_from(list(Schedule)),
    k=st.integers(1, 16),
    data=st.data(),
)
def test_schedule_figures_are_the_simulations(stages, schedule, k, data):
    """The search's fast pricing (``schedule_figures``) gives the full simulation's makespan, busy
    time and peaks, for any times, sends and bytes."""
    from autopar.cost_model.pipeline import schedule_figures

    v = data.draw(st.integers(2, 3)) if schedule.multi_chunk else 1
    n = stages * v
    fwd = [data.draw(st.floats(0.1, 3.0)) for _ in range(n)]
    bwd = [data.draw(st.floats(0.1, 5.0)) for _ in range(n)]
    act = [data.draw(st.floats(0.0, 9.0)) for _ in range(n)]
    p2p = [data.draw(st.floats(0.0, 1.0)) for _ in range(n - 1)]
    try:
        want = simulate_schedule(schedule, stages, v, k, fwd, bwd, p2p, act)
    except ScheduleError:
        return
    makespan, busy, peaks = schedule_figures(schedule, stages, v, k, fwd, bwd, p2p, act)
    assert makespan == pytest.approx(want.makespan, rel=1e-12)
    assert busy == pytest.approx(want.busy, rel=1e-12)
    assert peaks == pytest.approx(want.peak_bytes, rel=1e-12)
