"""A climb refused at once by its top rungs' memory bounds (``passes/ladder.py:_refused``) gives
what the climb rung by rung gives, and the proof it rests on holds on real tables:

* hypothesis: ladders of ZeRO 0-2 (offload, recomputation, micro-batches) whose memory bound falls
  as a rung relieves more, under limits that refuse all, some or none of them, priced as scripted:
  the climb with the shortcut and without it (``_refused`` stubbed out) return the same ``Climb``,
  and with it no rung under a top is bounded where every top passes the limit;
* a pipeline candidate's rows (``passes/rungs.py:PipelineRungs``: traded tables, then the fullest
  stage's rows) of a coarsened Llama on 2 x 2 CPU ranks, at its micro-batches: every rung's bound
  is at least that of every rung that relieves at least as much (``relieves_no_more``), so where
  the top passes the limit every rung does.
"""

from __future__ import annotations

import itertools
import math

import pytest
from harness import rung_tables
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.examples import llama_tiny
from autopar.options import Optimizer
from autopar.passes import ladder as ladder_mod
from autopar.passes.ladder import Lesson, Rung, RungTables, climb, relieves_no_more
from autopar.passes.memory_row import lower_bound_bytes
from autopar.passes.pipeline import Regions, in_flight, stage_tables
from autopar.passes.trades import apply_trades
from autopar.trades import Offload, Recompute, Schedule, Trades, ZeroStage

_RECOMPUTE = [Recompute.NONE, Recompute.SELECTIVE, Recompute.HALF_MATMULS, Recompute.FULL]


def _rungs(zs, ks, offload):
    out = []
    for z, r, k in itertools.product(zs, _RECOMPUTE, ks):
        axes = (0,) if z else ()
        out.append(Trades(recompute=r, micro_batches=k, zero_stage=z, data_axes=axes))
        if offload and z == ZeroStage.GRADIENTS:
            out.append(
                Trades(recompute=r, micro_batches=k, zero_stage=z, data_axes=axes, offload=Offload.OPTIMIZER)
            )
    return out


class _Scripted:
    """Rungs whose memory bound falls as they relieve more (each trade's bytes subtracted), and
    which price as scripted once under the limit; every bound asked is recorded."""

    def __init__(self, base, saves, objective, fits_from):
        self.base, self.saves, self.objective, self.fits_from = base, saves, objective, fits_from
        self.bounded: list[Trades] = []

    def admits(self, trades):
        return True

    def bound(self, t: Trades) -> float:
        self.bounded.append(t)
        z, r, k, o = self.saves
        return (
            self.base
            - z * int(t.zero_stage)
            - r * _RECOMPUTE.index(t.recompute)
            - k * math.log2(t.micro_batches)
            - o * (t.offload is not Offload.NONE)
        )

    def tables(self, trades):
        return RungTables(None, None)

    def price(self, trades, tables, best_objective):
        if tables.needed > self.fits_from:
            return Rung(Lesson.NO_PLAN, None, tables.needed)
        objective = self.objective + _RECOMPUTE.index(trades.recompute) + trades.micro_batches
        return Rung(Lesson.FITS, None, tables.needed, object(), objective, peak=tables.needed)


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from([[ZeroStage.NONE], [ZeroStage.NONE, ZeroStage.OPTIMIZER], list(ZeroStage)[:3]]),
    st.sampled_from([[1], [1, 2, 4], [1, 4, 16]]),
    st.booleans(),
    st.tuples(*[st.floats(0, 10, allow_nan=False)] * 4),
    st.floats(0, 200, allow_nan=False),
    st.floats(0, 200, allow_nan=False),
)
def test_refused_climb_is_the_climb_rung_by_rung(zs, ks, offload, saves, limit, fits_from):
    rungs = sorted(_rungs(zs, ks, offload), key=lambda t: (t.recompute.value, t.micro_batches, t.zero_stage))
    fast = _Scripted(100.0, saves, 5.0, fits_from)
    got = climb(rungs, fast, limit, math.inf)
    slow = _Scripted(100.0, saves, 5.0, fits_from)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ladder_mod, "_refused", lambda *a: False)
        want = climb(rungs, slow, limit, math.inf)
    assert (got.objective, got.mem_needed, got.tried, len(got.entries), len(got.solved)) == (
        want.objective,
        want.mem_needed,
        want.tried,
        len(want.entries),
        len(want.solved),
    )
    if want.mem_needed > limit and not want.solved:  # every rung past the limit
        # the tops alone bounded: one per offload kind here (ZeRO-2's with it relieves the most)
        assert len(fast.bounded) <= 2 < len(slow.bounded) or len(slow.bounded) <= 2


def test_a_ladder_with_zero_three_is_climbed_rung_by_rung():
    """ZeRO-3's gathered blocks can need more than a rung under it: no shortcut there."""
    rungs = _rungs(list(ZeroStage), [1, 2], False)
    pricer = _Scripted(100.0, (1.0, 1.0, 1.0, 0.0), 5.0, 0.0)
    out = climb(rungs, pricer, 10.0, math.inf)  # every rung past the limit
    assert out.mem_needed > 10.0 and len(pricer.bounded) > 2


@pytest.fixture(scope="module")
def llama():
    model, inputs = llama_tiny(batch=8, seq=32)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=4)
    return rung_tables(model, inputs, cluster, (2, 2)), cluster


def test_pipeline_rows_bound_falls_as_rungs_relieve_more(llama):
    r, cluster = llama
    regions = Regions.of(r.tg, r.blocks)
    stages, k = 2, 4
    rungs = [
        Trades(
            recompute=rc, micro_batches=k, precision=r.precision, zero_stage=z, data_axes=(0,) if z else ()
        )
        for z in (ZeroStage.NONE, ZeroStage.OPTIMIZER)
        for rc in _RECOMPUTE
    ]
    bound = {}
    for t in rungs:
        traded = apply_trades(r.tables, r.tg, r.cinfos, t, cluster, Optimizer.ADAM, r.blocks)
        rows = stage_tables(traded, r.cinfos, regions, stages, in_flight(Schedule.ONE_F_ONE_B, stages, k))
        bound[t] = lower_bound_bytes(rows)
    assert len(set(bound.values())) > 2  # the trades move the bound
    for a, b in itertools.product(rungs, rungs):
        if relieves_no_more(a, b):
            assert bound[a] >= bound[b] * (1 - 1e-12), (a.describe(), b.describe(), bound[a], bound[b])
