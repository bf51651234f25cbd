"""The two-stream timeline of cost_model/overlap.py and the plan-level pricing of passes/grad_sync.py."""

from __future__ import annotations

import dataclasses

import pytest
from harness import free_link_cpu
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.cost_model.comm import CommModel
from autopar.cost_model.overlap import gathers_ahead_exposed_s, hidden_seconds, two_stream
from autopar.examples import gpt2_tiny
from autopar.reshard import Collective

times = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)
# an all-reduce: one price, or (idle price, queued price <= idle price)
all_reduce_st = times | st.tuples(times, st.floats(0.0, 1.0)).map(lambda p: (p[0], p[0] * p[1]))
steps_st = st.lists(st.tuples(times, st.lists(all_reduce_st, max_size=3)), min_size=1, max_size=12)


def _event_sim(steps):
    """Discrete-event reference: a compute stream that never waits and a FIFO comm stream on
    which an all-reduce that waits for the previous one runs at its queued price."""
    events = []  # (ready time, idle price, queued price) in issue order
    clock = 0.0
    for c, issued in steps:
        clock += c
        events.extend((clock,) + ((r, r) if isinstance(r, float) else r) for r in issued)
    free = 0.0
    for ready, t_iso, t_q in events:
        free = (ready + t_iso) if ready >= free else (free + t_q)
    return max(clock, free)


@settings(max_examples=200, deadline=None)
@given(steps_st, st.floats(min_value=0.0, max_value=1.0))
def test_timeline_bounds(steps, eff):
    end, _ = two_stream(steps)
    compute = sum(c for c, _ in steps)
    iso = [r if isinstance(r, float) else r[0] for _, rs in steps for r in rs]
    queued = [r if isinstance(r, float) else r[1] for _, rs in steps for r in rs]
    assert end == pytest.approx(_event_sim(steps))
    assert max(compute, sum(queued)) - 1e-9 <= end <= compute + sum(iso) + 1e-9
    hidden = hidden_seconds(steps, eff)
    # never more than queueing saves plus the overlap of the shorter stream; never a negative price
    assert 0.0 <= hidden <= sum(iso) - sum(queued) + eff * min(compute, sum(iso)) + 1e-9
    assert compute + sum(iso) - hidden >= max(compute, sum(queued)) - 1e-9


def test_timeline_cases():
    # everything issued after the last step: nothing to hide behind
    assert hidden_seconds([(1.0, []), (2.0, [0.5, 0.5])], 1.0) == 0.0
    # each all-reduce shorter than the compute after it: all but the last is hidden
    steps = [(1.0, [0.4]), (1.0, [0.4]), (1.0, [0.4])]
    assert hidden_seconds(steps, 1.0) == pytest.approx(0.8)
    assert hidden_seconds(steps, 0.5) == pytest.approx(0.4)
    # a long all-reduce issued first: the rest of the compute hides under it
    assert hidden_seconds([(1.0, [5.0]), (2.0, [])], 1.0) == pytest.approx(2.0)
    # a burst issued together: the first runs idle, the others queued, whatever the device
    burst = [(1.0, [(1.0, 0.4)] * 3)]
    assert hidden_seconds(burst, 0.0) == pytest.approx(1.2)


def test_plan_step_time_falls_with_overlap_by_the_hidden_seconds(monkeypatch):
    """Same plan, device overlap 0 vs 1: the prediction drops by exactly the hidden seconds. With
    buckets of 16 KiB (a model this small fills one 25 MiB bucket, which completes only when
    backward ends: nothing to hide) several start while backward still computes."""
    from autopar.passes import grad_sync

    monkeypatch.setattr(grad_sync, "BUCKET_BYTES", 16 * 2**10)
    model, inputs = gpt2_tiny(batch=8, seq=32, hidden=64, vocab=256)
    base = free_link_cpu(2)
    plans = {}
    for eta in (0.0, 1.0):
        cl = base.with_overrides(device=dataclasses.replace(base.device, comm_overlap=eta))
        plans[eta] = autopar.plan(
            model,
            cl,
            inputs,
            mesh_shape=(2,),
            axis_roles=(autopar.AxisRole.DATA,),
            optimizer=autopar.Optimizer.SGD,
            zero_stage=0,  # the buckets' all-reduces alone overlap (ZeRO-1's gathers would too)
        )
    p0, p1 = plans[0.0].predicted, plans[1.0].predicted
    assert [d.output for d in plans[0.0].decisions] == [d.output for d in plans[1.0].decisions]
    assert p0.grad_sync_hidden_s == 0.0
    assert p1.grad_sync_hidden_s > 0.0
    assert p1.step_time_s == pytest.approx(p0.step_time_s - p1.grad_sync_hidden_s)
    overlapped = [
        d for d in plans[1.0].decisions if any(c.site is autopar.Site.BUCKET for c in d.collectives)
    ]
    assert overlapped and all(d.role == "param" for d in overlapped)


gathers_st = st.lists(st.tuples(times, times), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(gathers_st, st.floats(min_value=0.0, max_value=1.0))
def test_gathers_ahead_bounds(pairs, eff):
    """ZeRO-1's gathers behind the next forward: the first bucket and whatever the compute before
    the last read cannot cover stay exposed; never more than all of them; the device's
    efficiency scales what is hidden, 0 hiding nothing."""
    g, w = [p[0] for p in pairs], [p[1] for p in pairs]
    ideal = gathers_ahead_exposed_s(g, w, 1.0)
    assert max(g[0], sum(g) - sum(w[:-1])) - 1e-9 <= ideal <= sum(g) + 1e-9
    assert gathers_ahead_exposed_s(g, w, 0.0) == pytest.approx(sum(g))
    assert gathers_ahead_exposed_s(g, w, eff) == pytest.approx(sum(g) - eff * (sum(g) - ideal))


def test_gathers_ahead_cases():
    # gathers longer than the compute between reads: the first, and each one's excess, exposed
    # (FSDP's prefetch form g_1 + sum max(0, g_{j+1} - c_j))
    assert gathers_ahead_exposed_s([3.0] * 4, [1.0] * 4, 1.0) == pytest.approx(3.0 + 3 * 2.0)
    # shorter: only the first
    assert gathers_ahead_exposed_s([1.0] * 4, [3.0] * 4, 1.0) == pytest.approx(1.0)
    # one long gather early: the compute behind it runs ahead, the later ones land in time
    assert gathers_ahead_exposed_s([1.0, 5.0, 0.5, 0.5], [1.0, 4.0, 4.0, 1.0], 1.0) == pytest.approx(
        1.0 + 4.0
    )


def test_zero_one_gathers_hide_behind_the_next_forward():
    """A plan with ZeRO-1 forced: its gathers priced at device overlap 0 are the all-gathers of
    every parameter over the data axis, all exposed; at overlap 1 less, but never less than the
    first block's gather (nothing runs before it)."""
    model, inputs = gpt2_tiny(batch=8, seq=32, hidden=64, vocab=256)
    base = free_link_cpu(2)
    zero = {}
    for eta in (0.0, 1.0):
        cl = base.with_overrides(device=dataclasses.replace(base.device, comm_overlap=eta))
        plan = autopar.plan(
            model, cl, inputs, mesh_shape=(2,), axis_roles=(autopar.AxisRole.DATA,), zero_stage=1,
            optimizer=autopar.Optimizer.SGD,
        )  # fmt: skip
        zero[eta] = plan.trade_costs["zero"]["seconds"]
    comm = CommModel(base, (2,))
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    assert zero[0.0] == pytest.approx(comm.time(Collective.ALL_GATHER, whole, 0), rel=0.05)
    assert 0.0 < zero[1.0] < zero[0.0]


def test_gradient_buckets_hide_behind_the_last_micro_batch_only(monkeypatch):
    """With k micro-batches the buckets reduce in the last backward only (``ParallelModule.step``):
    the timeline they are priced on is that backward, 1/k of the step's compute."""
    from autopar.passes import grad_sync

    monkeypatch.setattr(grad_sync, "BUCKET_BYTES", 16 * 2**10)
    seen = []
    real = grad_sync.price_grad_sync

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(grad_sync, "price_grad_sync", spy)
    import autopar.passes.price as price

    monkeypatch.setattr(price, "price_grad_sync", spy)
    model, inputs = gpt2_tiny(batch=8, seq=32, hidden=64, vocab=256)
    cl = free_link_cpu(2)
    cl = cl.with_overrides(device=dataclasses.replace(cl.device, comm_overlap=1.0))
    autopar.plan(model, cl, inputs, mesh_shape=(2,), axis_roles=(autopar.AxisRole.DATA,), micro_batches=4)
    args, kwargs = seen[-1]
    assert (args[9] if len(args) > 9 else kwargs["micro_batches"]) == 4
    kwargs = {k: v for k, v in kwargs.items() if k != "micro_batches"}
    steps = []

    def timeline(s, efficiency):
        steps.append(s)
        return 0.0

    monkeypatch.setattr(grad_sync, "hidden_seconds", timeline)
    for k in (1, 4):
        real(*args[:9], micro_batches=k, **kwargs)
    whole, last = sum(c for c, _ in steps[0]), sum(c for c, _ in steps[1])
    assert whole > 0 and last == pytest.approx(whole / 4)
    assert [r for _, rs in steps[0] for r in rs] == [r for _, rs in steps[1] for r in rs]


def test_pipelined_plan_hides_no_gradient_reduction(monkeypatch):
    """A pipelined step reduces its buckets after the schedule (``PipelinedModule.step``): the same
    small buckets that hide behind an unpipelined backward hide behind nothing there."""
    from autopar.passes import grad_sync

    monkeypatch.setattr(grad_sync, "BUCKET_BYTES", 16 * 2**10)
    model, inputs = gpt2_tiny(batch=8, seq=32, hidden=64, vocab=256)
    hidden = {}
    for stages in (1, 2):
        cl = free_link_cpu(2 * stages)
        cl = cl.with_overrides(device=dataclasses.replace(cl.device, comm_overlap=1.0))
        plan = autopar.plan(
            model, cl, inputs, mesh_shape=(2,), axis_roles=(autopar.AxisRole.DATA,), pipeline_stages=stages,
            micro_batches=2, optimizer=autopar.Optimizer.SGD,
        )  # fmt: skip
        assert plan.pipeline.stages == stages and any(
            c.site is autopar.Site.BUCKET for d in plan.decisions for c in d.collectives
        )
        hidden[stages] = plan.predicted.grad_sync_hidden_s
    assert hidden[1] > 0.0 and hidden[2] == 0.0
