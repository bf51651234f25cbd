"""The two-stream timeline of cost_model/overlap.py and the plan-level pricing of passes/grad_sync.py."""

from __future__ import annotations

import dataclasses

import pytest
from harness import free_link_cpu
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.cost_model.overlap import hidden_seconds, two_stream
from autopar.examples import gpt2_tiny

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
