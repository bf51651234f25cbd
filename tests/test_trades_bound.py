"""The two proofs the search's rungs are cut short by (``passes/mesh_solve.py``) hold:

* the trades' time lower bound (``passes/trade_terms.py:terms_lower_bound``), taken off the ILP's
  cutoff (the best objective so far), is at most the trades' terms (``trade_terms``) of every
  choice on the rung's tables: checked on real tables (a coarsened Llama on a 2 x 2 mesh of CPU ranks, every
  ZeRO-2/3 rung of its ladder) against random choices and the choice of each parameter's
  smallest piece;
* a re-solve under less room than the rung's memory lower bound is skipped as having no plan:
  the ILP finds none there (hypothesis over small problems, as ``tests/test_solver.py`` draws them).
"""

from __future__ import annotations

import random

import pytest
from harness import rung_tables
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_solver import brute_force, problems

import autopar
from autopar.examples import llama_tiny
from autopar.options import Optimizer
from autopar.passes.memory_row import lower_bound_bytes
from autopar.passes.solver import solve
from autopar.passes.trade_terms import terms_lower_bound, trade_terms
from autopar.passes.trades import apply_trades, piece_elems
from autopar.trades import ZeroStage


@pytest.fixture(scope="module")
def llama():
    model, inputs = llama_tiny(batch=8, seq=32)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=4)
    return rung_tables(model, inputs, cluster, (2, 2)), cluster


def test_terms_bound_holds_for_every_choice_on_every_zero_rung(llama):
    r, cluster = llama
    tables, cinfos, blocks = r.tables, r.cinfos, r.blocks
    rungs = [t for t in r.rungs if t.zero_stage >= ZeroStage.GRADIENTS]
    assert len(rungs) > 10 and any(t.micro_batches > 1 for t in rungs)
    rng = random.Random(0)
    # each parameter at its smallest piece (what the bound assumes), the rest at random
    least = {
        v: min(range(len(s)), key=lambda i: piece_elems(cinfos[v], s[i].out, tables.mesh_shape))
        for v, s in tables.strategies.items()
    }
    positive = 0
    for t in rungs:
        traded = apply_trades(tables, r.tg, cinfos, t, cluster, Optimizer.ADAM, blocks)
        bound = terms_lower_bound(traded, cinfos, t, cluster, blocks, {})
        assert bound == terms_lower_bound(traded, cinfos, t, cluster, blocks)  # the cache changes nothing
        positive += bound > 0
        choices = [least] + [
            {v: rng.randrange(len(s)) for v, s in tables.strategies.items()} for _ in range(20)
        ]
        for choice in choices:
            got = trade_terms(tables, traded, choice, cinfos, t, cluster, Optimizer.ADAM, blocks).total_s
            assert bound <= got * (1 + 1e-12), (t.describe(), bound, got)
    assert positive == len(rungs)  # ZeRO-2/3 over a data axis always has exposed gathers


def test_terms_bound_is_zero_below_zero_two(llama):
    r, cluster = llama
    for t in r.rungs:
        if t.zero_stage < ZeroStage.GRADIENTS:
            assert terms_lower_bound(r.tables, r.cinfos, t, cluster, r.blocks) == 0.0


@settings(max_examples=60, deadline=None)
@given(problems(), st.floats(0.5, 0.999))
def test_no_plan_under_the_memory_lower_bound(problem, share):
    """``solve_mesh`` skips its re-solve where the room left is under the memory lower bound: the
    ILP has no plan there (and brute force none either)."""
    tables, _ = problem
    needed = lower_bound_bytes(tables)
    assume(needed > 0.1)  # a limit under zero bytes is no question the search asks
    # under the bound by 0.1-50%, past the solvers' tolerances (tables whose every node has one
    # strategy included: HiGHS proves those infeasible with no column values, lp_model.py)
    limit = needed * share
    assert brute_force(tables, limit) is None
    assert solve(tables, limit) is None
