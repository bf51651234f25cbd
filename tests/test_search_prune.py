"""The search's cheap prunes keep the optimum: a rung of the trades ladder skipped because a rung it
"costs no less than" was pruned by its time lower bound (``passes/ladder.py:costs_no_less``) has a
bound at least that rung's, computed here for every rung of the ladder, on a CPU cluster and on a
GPU preset; and the search with the skip plans what it plans with every bound computed."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import autopar
from autopar.examples import gpt2_tiny, llama, llama_tiny
from autopar.options import AxisRole, Optimizer, SearchOptions
from autopar.passes import ladder as ladder_mod
from autopar.passes.analyze import analyze
from autopar.passes.blocks import find_blocks
from autopar.passes.costs import build_costs
from autopar.passes.ladder import costs_no_less
from autopar.passes.precision import auto_precision, autocast_device, half_infos
from autopar.passes.solver import fold_followers, lower_bound
from autopar.passes.strategies import build_strategies
from autopar.passes.trace import trace
from autopar.passes.trades import apply_trades, ladder


def _bounds(model, inputs, cluster, mesh):
    tg = trace(model, inputs)
    infos = analyze(tg)
    precision = auto_precision(infos)
    cinfos = half_infos(tg, infos, precision, autocast_device(cluster))
    roles = (AxisRole.DATA,) + (AxisRole.AUTO,) * (len(mesh) - 1)
    strats = build_strategies(tg, infos, mesh, roles)
    tables = build_costs(tg, cinfos, strats, cluster, mesh, Optimizer.ADAM, roles)
    blocks = find_blocks(tg)
    batch = next(iter(inputs.values())).shape[0]
    out = {}
    for t in ladder(SearchOptions(), (0,), precision, batch, bool(blocks)):
        traded = apply_trades(tables, tg, cinfos, t, cluster, Optimizer.ADAM, blocks)
        out[t] = lower_bound(traded, fold_followers(traded, exact=True))
    return out


CASES = {
    "llama-cpu4": lambda: (
        *llama_tiny(batch=8, seq=32),
        autopar.ClusterSpec.preset("cpu", devices_per_node=4),
        (4,),
    ),
    "gpt2-cpu2": lambda: (
        *gpt2_tiny(batch=8, seq=32),
        autopar.ClusterSpec.preset("cpu", devices_per_node=2),
        (2,),
    ),
}


def _meta_llama():
    with torch.device("meta"):
        model, inputs = llama(
            layers=4, hidden=512, ffn=1024, heads=8, kv_heads=2, vocab=2048, batch=16, seq=256
        )
    return model, inputs, autopar.ClusterSpec.preset("h100-sxm", devices_per_node=8), (8,)


CASES["llama-bf16-h100x8"] = _meta_llama


@pytest.mark.parametrize("case", sorted(CASES))
def test_rungs_that_cost_no_less_have_no_lower_bound(case):
    model, inputs, cluster, mesh = CASES[case]()
    bounds = _bounds(model, inputs, cluster, mesh)
    assert len(bounds) > 20
    pairs = 0
    for a, b in itertools.permutations(bounds, 2):
        if costs_no_less(a, b):
            pairs += 1
            assert bounds[a] >= bounds[b] * (1 - 1e-9), (a.describe(), b.describe(), bounds[a], bounds[b])
    assert pairs > 20


def test_the_skip_keeps_the_plan(monkeypatch):
    """A bf16 Llama on 16 H100s: once the first mesh's plan is the best, the other meshes' ladders
    are pruned rung after rung; the plan is the same with the skip and with every bound computed."""
    with torch.device("meta"):
        model, inputs = llama(
            layers=4, hidden=512, ffn=1024, heads=8, kv_heads=2, vocab=2048, batch=64, seq=512
        )
    cluster = autopar.ClusterSpec.preset("h100-sxm", nodes=2, devices_per_node=8)
    local = dict(outputs=autopar.Outputs.LOCAL)
    with_skip = autopar.plan(model, cluster, inputs, **local)
    monkeypatch.setattr(ladder_mod, "costs_no_less", lambda a, b: False)
    without = autopar.plan(model, cluster, inputs, **local)
    assert with_skip.trades == without.trades and with_skip.mesh_shape == without.mesh_shape
    assert with_skip.predicted.step_time_s == pytest.approx(without.predicted.step_time_s, rel=1e-9)
    assert len(with_skip.solver.candidates) < len(without.solver.candidates)  # the skip acted


class _ScriptedRungs:
    """A candidate whose rungs price as scripted: trades -> (objective, peak bytes); None: no plan."""

    def __init__(self, script):
        self.script, self.priced = script, []

    def admits(self, trades):
        return True

    def tables(self, trades):
        from autopar.passes.ladder import RungTables

        return RungTables(None, None)  # the memory bound is stubbed: nothing reads them

    def price(self, trades, tables, best_objective):
        from autopar.passes.ladder import Lesson, Rung

        self.priced.append(trades.micro_batches)
        got = self.script[trades.micro_batches]
        if got is None:
            return Rung(Lesson.NO_PLAN)
        objective, peak = got
        return Rung(Lesson.FITS, None, peak, object(), objective, peak=peak)


@pytest.mark.parametrize(
    "script, priced, best",
    [
        # the first plan fits with room: later rungs only add time, the climb ends there
        ({1: (10.0, 50.0), 2: (8.0, 40.0), 4: (7.0, 30.0), 8: (6.0, 20.0)}, [1], 10.0),
        # the first fits at 95% of the limit, its placement maybe bent by it: later rungs are
        # solved while the best is that tight, a worse one with room does not end the climb
        ({1: (10.0, 95.0), 2: (12.0, 60.0), 4: (7.0, 50.0), 8: (6.0, 40.0)}, [1, 2, 4], 7.0),
        # at most RUNGS_SOLVED_TIGHT plans that fit, however tight
        (
            {1: (10.0, 99.0), 2: (9.0, 99.0), 4: (8.0, 99.0), 8: (7.0, 99.0), 16: (6.0, 99.0)},
            [1, 2, 4, 8],
            7.0,
        ),
    ],
)
def test_climb_goes_on_while_the_best_plan_is_tight(monkeypatch, script, priced, best):
    from autopar.trades import Trades

    monkeypatch.setattr(ladder_mod, "lower_bound_bytes", lambda tables: 0.0)
    assert ladder_mod.RUNGS_SOLVED_TIGHT == 4
    rungs = [Trades(micro_batches=k) for k in script]
    pricer = _ScriptedRungs(script)
    out = ladder_mod.climb(rungs, pricer, limit=100.0, best_objective=math.inf)
    assert pricer.priced == priced
    assert out.objective == best


def test_sharded_step_siblings():
    from autopar.passes.ladder import sharded_step_sibling
    from autopar.trades import Recompute, Trades, ZeroStage

    def t(z, r=Recompute.NONE, k=1):
        return Trades(recompute=r, micro_batches=k, zero_stage=z, data_axes=(0,) if z else ())

    Z0, Z1, Z2, Z3 = ZeroStage.NONE, ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS, ZeroStage.PARAMETERS
    assert sharded_step_sibling(t(Z1), t(Z0)) and sharded_step_sibling(t(Z2), t(Z0))
    assert sharded_step_sibling(t(Z2), t(Z1)) and not sharded_step_sibling(t(Z1), t(Z2))
    assert not sharded_step_sibling(t(Z3), t(Z0))  # ZeRO-3 gathers in every forward and backward
    assert not sharded_step_sibling(t(Z1, k=2), t(Z0)) and not sharded_step_sibling(
        t(Z1, Recompute.FULL), t(Z0)
    )


def test_climb_solves_the_sharded_step_siblings_of_its_last_plan(monkeypatch):
    """ZeRO-1 and ZeRO-2 of the rung that fit are solved before the climb ends: they can be faster
    (the optimizer steps 1/d of the state); other rungs after it are not (they add time)."""
    from autopar.passes.ladder import Lesson, Rung, RungTables
    from autopar.trades import Recompute, Trades, ZeroStage

    monkeypatch.setattr(ladder_mod, "lower_bound_bytes", lambda tables: 0.0)
    Z0, Z1, Z2 = ZeroStage.NONE, ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS
    script = {
        (Z0, Recompute.NONE): None,  # no plan
        (Z0, Recompute.SELECTIVE): 10.0,  # fits with room: the climb would end here
        (Z1, Recompute.SELECTIVE): 9.0,  # ZeRO-1 of it: faster
        (Z2, Recompute.SELECTIVE): 9.5,
        (Z0, Recompute.FULL): 5.0,  # a later rung: not solved
        (Z1, Recompute.FULL): 4.0,
    }
    priced = []

    class Pricer:
        def admits(self, trades):
            return True

        def tables(self, trades):
            return RungTables(None, None)

        def price(self, trades, tables, best_objective):
            key = (trades.zero_stage, trades.recompute)
            priced.append(key)
            if script[key] is None:
                return Rung(Lesson.NO_PLAN)
            return Rung(Lesson.FITS, None, 1.0, type("S", (), {"trades": trades})(), script[key], peak=1.0)

    rungs = [Trades(recompute=r, zero_stage=z, data_axes=(0,) if z else ()) for z, r in script]
    out = ladder_mod.climb(rungs, Pricer(), limit=100.0, best_objective=math.inf)
    assert priced == [
        (Z0, Recompute.NONE),
        (Z0, Recompute.SELECTIVE),
        (Z1, Recompute.SELECTIVE),
        (Z2, Recompute.SELECTIVE),
    ]
    assert out.objective == 9.0


def test_free_candidates_after_the_data_parallel_ones_where_memory_binds(monkeypatch):
    """Under a memory limit that binds, the free candidates are solved after every data-parallel
    one (their step prunes the free ILPs, the slowest solves under memory rows); the plan is the
    one the search finds in the usual order."""
    from autopar.passes import search as search_mod

    model, inputs = llama_tiny(batch=8, seq=32)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=4)
    free = autopar.plan(model, cluster, inputs)
    limit = 0.6 * free.predicted.peak_memory_bytes / (1 - cluster.memory_reserve)
    deferred = autopar.plan(model, cluster, inputs, memory_limit_bytes=limit)
    monkeypatch.setattr(search_mod, "memory_binds", lambda tables, limit: False)
    usual = autopar.plan(model, cluster, inputs, memory_limit_bytes=limit)
    assert deferred.mesh_shape == usual.mesh_shape and deferred.trades == usual.trades
    assert deferred.predicted.step_time_s == pytest.approx(usual.predicted.step_time_s, rel=1e-9)

    def order(plan):  # (mesh, free?) of each SPMD candidate, in the order they were tried
        return [(tuple(c["mesh_shape"]), c.get("axis_roles") is None) for c in plan.solver.candidates]

    first_free = order(deferred).index(((4,), True))
    assert ((2, 2), False) in order(deferred)[:first_free]  # the (2, 2) data-parallel one came first
    assert order(usual).index(((4,), True)) < order(usual).index(((2, 2), False))
