"""Partial recomputation (``Trades.recompute_blocks``: the first ``N`` repeated blocks of each
pipeline chunk recompute, the rest keep every activation; Megatron-LM's ``--recompute-method block
--recompute-num-layers N``).

* the trade: validated with the fix in the message, in the plan's JSON (old plans load), which
  blocks it names (``recomputed_blocks``);
* pricing (``passes/trades.py:partly_recomputed``): ``N = 0`` gives exactly the ``NONE`` rows,
  ``N = L`` exactly the whole mode's, and every row moves monotonically in between (more seconds,
  fewer bytes kept); on a pipeline the blocks are chosen per stage;
* the peak a forced partial plan predicts is at least what one CPU device holds (the tables' sum
  of what is kept is an upper bound wherever the kept blocks lie);
* gloo world 2 (slow): a tiny Llama of 4 blocks, FULL on 2 of 4 over a tensor axis, and on 2
  pipeline stages FULL on 1 of each stage's 2 (1F1B, and interleaved: the first block each rank
  runs), SELECTIVE on 3 of 4 over a data axis: only those blocks are checkpointed, and the losses
  and the state after two Adam steps equal one device's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest
import torch
import torch.distributed as dist
from harness import D, T, adam_reference, assert_adam_state_close, rung_tables
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.demo import train_step
from autopar.examples import llama_tiny
from autopar.launch import free_port, run_on_ranks
from autopar.options import Optimizer, SearchOptions, SearchOptionsError
from autopar.passes.ladder import costs_no_less, recomputes_no_more, relieves_no_more
from autopar.passes.trades import apply_trades, ladder
from autopar.trades import Pipeline, Recompute, Schedule, Trades, TradesError, recomputed_blocks

FULL, NONE = Recompute.FULL, Recompute.NONE
LR, STEPS = 1e-3, 2
ROWS = ("node_cost", "node_mem", "node_peak", "grad_mem", "step_peak")


# -- the trade ----------------------------------------------------------------------------------


def test_the_trade_is_validated_and_round_trips():
    with pytest.raises(TradesError, match="recompute=full"):
        Trades(recompute=NONE, recompute_blocks=2)
    with pytest.raises(TradesError, match=">= 0"):
        Trades(recompute=FULL, recompute_blocks=-1)
    with pytest.raises(TradesError, match=">= 0"):
        Trades(recompute=FULL, recompute_blocks=True)
    with pytest.raises(SearchOptionsError, match="recompute=full"):
        SearchOptions(recompute=NONE, recompute_blocks=1)
    t = Trades(recompute=FULL, recompute_blocks=3, micro_batches=2)
    assert Trades.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    assert "recompute full on the first 3 blocks per stage" in t.describe()
    old = Trades(recompute=FULL).to_dict()
    assert "recompute_blocks" not in old  # plans without it read as before
    assert Trades.from_dict(old).recompute_blocks is None


def test_recomputed_blocks_are_the_first_of_each_stage():
    assert recomputed_blocks(4, None) == {0, 1, 2, 3}
    assert recomputed_blocks(4, 2) == {0, 1}
    assert recomputed_blocks(4, 0) == set()
    assert recomputed_blocks(4, 9) == {0, 1, 2, 3}
    assert recomputed_blocks(8, 1, (3, 5)) == {0}  # one rank runs the three chunks
    assert recomputed_blocks(8, 2, Pipeline.even_cuts(8, 2), 2) == {0, 1, 4, 5}
    # interleaved: rank 0 runs chunks 0 and 2 (blocks 0, 1, 4, 5), rank 1 chunks 1 and 3
    assert recomputed_blocks(8, 3, (2, 4, 6), 2) == {0, 1, 4, 2, 3, 6}
    assert Trades(recompute=NONE).recomputed(4) == set()


def test_a_forced_count_makes_every_rung_recompute_that_many():
    rungs = ladder(SearchOptions(recompute_blocks=2), (0,), autopar.Precision.PARAM, 8, True)
    assert rungs and all(t.recompute is not NONE and t.recompute_blocks == 2 for t in rungs)
    assert {t.recompute for t in rungs} == {Recompute.SELECTIVE, Recompute.HALF_MATMULS, FULL}


def test_partial_rungs_are_ordered_against_whole_ones():
    """``passes/ladder.py``: a partial rung frees (and costs) no more than the same mode on more
    blocks, at least as much as none; against a whole rung of a lower mode it is not ordered."""
    full = Trades(recompute=FULL)
    part = dataclasses.replace(full, recompute_blocks=2)
    half = Trades(recompute=Recompute.HALF_MATMULS)
    assert recomputes_no_more(part, full) and not recomputes_no_more(full, part)
    assert recomputes_no_more(Trades(), part) and not recomputes_no_more(part, Trades())
    assert recomputes_no_more(dataclasses.replace(part, recompute_blocks=1), part)
    assert not recomputes_no_more(part, half) and not recomputes_no_more(half, part)
    assert relieves_no_more(part, full) and not relieves_no_more(full, part)
    assert costs_no_less(full, part) and not costs_no_less(part, full)


# -- pricing ------------------------------------------------------------------------------------

L = 4


@functools.cache
def _llama4():
    model, inputs = llama_tiny(batch=8, seq=32, layers=L, hidden=64, vocab=256)
    return rung_tables(model, inputs, autopar.ClusterSpec.preset("cpu", devices_per_node=2), (2,))


@pytest.fixture(scope="module")
def llama4():
    return _llama4()


def _traded(r, trades, cuts=(), stages=1):
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    return apply_trades(r.tables, r.tg, r.cinfos, trades, cluster, Optimizer.ADAM, r.blocks, cuts, stages)


def _rows(tables):
    out = {f: dict(getattr(tables, f)) for f in ROWS}
    out["edges"] = [(e.cost, e.mem) for e in tables.edges]
    return out


@pytest.mark.parametrize("mode", [FULL, Recompute.SELECTIVE, Recompute.HALF_MATMULS])
def test_none_and_all_blocks_price_as_none_and_the_whole_mode_exactly(llama4, mode):
    base = Trades(recompute=mode, micro_batches=2)
    none = _rows(_traded(llama4, dataclasses.replace(base, recompute=NONE)))
    whole = _rows(_traded(llama4, base))
    assert none != whole
    assert _rows(_traded(llama4, dataclasses.replace(base, recompute_blocks=0))) == none
    assert _rows(_traded(llama4, dataclasses.replace(base, recompute_blocks=L))) == whole
    part = _rows(_traded(llama4, dataclasses.replace(base, recompute_blocks=L // 2)))
    assert part != none and part != whole


def _totals(tables):
    """Every finite entry's sum, of the seconds and of the kept bytes (the rows all choices share)."""

    def fin(xs):
        return sum(x for x in xs if math.isfinite(x))

    secs = sum(fin(r) for r in tables.node_cost.values()) + sum(fin(c) for e in tables.edges for c in e.cost)
    kept = sum(fin(r) for r in tables.node_mem.values()) + sum(fin(m) for e in tables.edges for m in e.mem)
    return secs, kept


@settings(max_examples=12, deadline=None)
@given(a=st.integers(0, L), b=st.integers(0, L), cut=st.booleans())
def test_rows_move_monotonically_in_the_count(a, b, cut):
    """More recomputed blocks: no entry of a node's row costs fewer seconds, and the rows' seconds
    rise and their kept bytes fall (summed: a block's output is kept by its node under FULL, by
    the edges into the next block under NONE), strictly where more blocks recompute."""
    lo, hi = min(a, b), max(a, b)
    cuts, stages = (Pipeline.even_cuts(L, 2), 2) if cut else ((), 1)
    t_lo = _traded(_llama4(), Trades(recompute=FULL, recompute_blocks=lo), cuts, stages)
    t_hi = _traded(_llama4(), Trades(recompute=FULL, recompute_blocks=hi), cuts, stages)
    for v, row in t_lo.node_cost.items():
        for x, y in zip(row, t_hi.node_cost[v]):
            assert y >= x - 1e-12 * abs(x) or not math.isfinite(x), v
    s_lo, k_lo = _totals(t_lo)
    s_hi, k_hi = _totals(t_hi)
    assert s_hi >= s_lo * (1 - 1e-12) and k_hi <= k_lo * (1 + 1e-12)
    n_lo = len(recomputed_blocks(L, lo, cuts, stages))
    n_hi = len(recomputed_blocks(L, hi, cuts, stages))
    if n_hi > n_lo:
        assert k_hi < k_lo and s_hi > s_lo


@settings(max_examples=16, deadline=None)
@given(
    n=st.integers(1, L - 1),
    mode=st.sampled_from([FULL, Recompute.SELECTIVE, Recompute.HALF_MATMULS]),
    k=st.sampled_from([1, 2, 4]),
)
def test_the_climbs_bound_of_a_partial_rung_is_its_tables_bound(n, mode, k):
    """``traded_lower_bound`` of a partly recomputed rung, priced from the two sides' node rows and
    the edges' least terms without building their traded edges, is the memory lower bound of the
    mixed tables the rung's ILP solves, bit for bit."""
    from autopar.passes.memory_row import lower_bound_bytes
    from autopar.passes.trades import traded_lower_bound

    r = _llama4()
    trades = Trades(recompute=mode, micro_batches=k, recompute_blocks=n)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    cheap = traded_lower_bound(r.tables, r.cinfos, trades, cluster, Optimizer.ADAM, r.blocks)
    assert cheap == lower_bound_bytes(_traded(r, trades))


def test_kept_bytes_are_linear_in_the_recomputed_blocks(llama4):
    """Each block kept or recomputed, whole: the kept bytes fall by the same amount per block."""
    kept = [_totals(_traded(llama4, Trades(recompute=FULL, recompute_blocks=n)))[1] for n in range(L + 1)]
    steps = [a - b for a, b in zip(kept, kept[1:])]
    assert min(steps) > 0
    assert max(steps) - min(steps) <= 1e-9 * kept[0]


def test_a_pipeline_prices_each_stage_on_its_own_blocks():
    """A pipeline of 2 stages of 2 blocks, repriced (``autopar.reprice``: the plan's placements,
    ``passes/pipeline.py:price_pipeline`` per member) with 0, 1 and 2 blocks of each stage
    recomputed: each chunk's activation bytes and backward seconds with 1 are the mean of those
    with 0 and 2 (one block kept, one recomputed, exactly), the step rises with the count, and the
    plan the search priced at 1 reprices to its own figures."""
    model, inputs = llama_tiny(batch=8, seq=32, layers=L, hidden=64, vocab=256)
    cpu2 = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    plan = autopar.plan(
        model, cpu2, inputs, pipeline_stages=2, schedule=Schedule.ONE_F_ONE_B, micro_batches=2,
        mesh_shape=(1,), recompute=FULL, recompute_blocks=1,
    )  # fmt: skip
    assert plan.pipeline.stages == 2 and plan.pipeline.cuts == (2,)
    got = {}
    for n in (0, 1, 2):
        p = dataclasses.replace(plan, trades=dataclasses.replace(plan.trades, recompute_blocks=n))
        got[n] = autopar.reprice(model, cpu2, inputs, p)
    assert got[1].predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert got[0].predicted.step_time_s < got[1].predicted.step_time_s < got[2].predicted.step_time_s
    for c in range(2):
        for key in ("activation_bytes", "backward_s"):
            lo, mid, hi = (got[n].stage_costs[c][key] for n in (0, 1, 2))
            assert lo != hi, (c, key)
            assert mid == pytest.approx((lo + hi) / 2, rel=1e-9), (c, key)


# -- the peak on one device -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_predicted_peak_bounds_the_measured_one(one_rank):
    """Measured as ``tests/test_trades_memory.py`` measures the whole modes: each partial plan's
    predicted peak is at least what the step holds, and the measured peaks fall with the count."""
    from autopar.tools.measure import peak_step_memory

    cpu1 = autopar.ClusterSpec.preset("cpu", devices_per_node=1)
    measured = []
    for n in (0, 2, 4):
        torch.manual_seed(0)
        model, inputs = llama_tiny(batch=8, seq=64, hidden=128, vocab=512, layers=L)
        plan = autopar.plan(
            model,
            cpu1,
            inputs,
            optimizer=autopar.Optimizer.SGD,
            recompute=FULL,
            recompute_blocks=n,
            micro_batches=1,
        )
        assert plan.trades.recompute_blocks == n
        pm = autopar.autoparallelize(model, cpu1, inputs, plan=plan)
        assert sum(hasattr(m, "recompute") for m in pm.modules()) == n
        opt = torch.optim.SGD(pm.parameters(), lr=0.01)
        train_step(pm, opt, inputs)
        got = peak_step_memory(pm, lambda pm=pm, opt=opt, inputs=inputs: train_step(pm, opt, inputs))
        print(n, plan.predicted.peak_memory_bytes, got)
        assert plan.predicted.peak_memory_bytes >= got, n
        assert plan.predicted.peak_memory_bytes <= 1.25 * got, n  # a bound, not a guess
        measured.append(got)
    assert measured[0] > measured[1] > measured[2]


def _plan_cpu1(limit=None, **options):
    model, inputs = llama_tiny(batch=8, seq=64, hidden=128, vocab=512, layers=L)
    cpu1 = autopar.ClusterSpec.preset("cpu", devices_per_node=1)
    return autopar.plan(
        model, cpu1, inputs, optimizer=autopar.Optimizer.SGD, micro_batches=1, memory_limit_bytes=limit, **options
    )  # fmt: skip


def test_the_search_recomputes_only_the_blocks_the_memory_needs():
    """Under a limit that FULL on 3 of the 4 blocks fits and no cheaper whole mode does, the search
    takes a partial rung (its step between none's and full's); forced recompute=full recomputes
    every block, as a published layout that ran so."""
    cpu1 = autopar.ClusterSpec.preset("cpu", devices_per_node=1)
    peak = {}
    for key, opts in {
        "part": dict(recompute=FULL, recompute_blocks=L - 1),
        "half": dict(recompute=Recompute.HALF_MATMULS),
        "selective": dict(recompute=Recompute.SELECTIVE),
        "full": dict(recompute=FULL),
    }.items():
        plan = _plan_cpu1(**opts)
        peak[key] = (plan.predicted.peak_memory_bytes, plan.predicted.step_time_s)
    assert peak["part"][0] < min(peak["half"][0], peak["selective"][0])
    usable = (peak["part"][0] + min(peak["half"][0], peak["selective"][0])) / 2
    limit = usable / (1 - cpu1.memory_reserve)
    got = _plan_cpu1(limit)
    assert got.trades.recompute is FULL and got.trades.recompute_blocks is not None, got.trades.describe()
    assert 0 < got.trades.recompute_blocks < L
    assert got.predicted.peak_memory_bytes <= cpu1.memory_limit(limit)
    assert got.predicted.step_time_s < peak["full"][1]
    forced = _plan_cpu1(limit, recompute=FULL)
    assert forced.trades.recompute_blocks is None
    assert forced.predicted.step_time_s > got.predicted.step_time_s


# -- two gloo ranks -----------------------------------------------------------------------------

CASES = {
    # key -> autopar.plan options
    "tp2 full 2 of 4": dict(mesh_shape=(2,), axis_roles=(T,), recompute=FULL, recompute_blocks=2, micro_batches=1),
    "pp2 full 1 of 2 per stage": dict(
        pipeline_stages=2, schedule=Schedule.ONE_F_ONE_B, micro_batches=2, mesh_shape=(1,), recompute=FULL,
        recompute_blocks=1,
    ),
    "pp2 interleaved full 1 of 2 per stage": dict(
        pipeline_stages=2, schedule=Schedule.INTERLEAVED_1F1B, virtual_stages=2, micro_batches=2, mesh_shape=(1,),
        recompute=FULL, recompute_blocks=1,
    ),
    "dp2 selective 3 of 4": dict(
        mesh_shape=(2,), axis_roles=(D,), recompute=Recompute.SELECTIVE, recompute_blocks=3, micro_batches=1
    ),
}  # fmt: skip
CHECKPOINTED = {
    "tp2 full 2 of 4": {0, 1},
    "pp2 full 1 of 2 per stage": {0, 2},
    "pp2 interleaved full 1 of 2 per stage": {0, 1},  # rank 0 runs blocks 0 and 2, rank 1 blocks 1 and 3
    "dp2 selective 3 of 4": {0, 1, 2},
}


def _build():
    return llama_tiny(batch=8, seq=16, hidden=32, vocab=128, layers=L)


def _rank(rank, world, jobs):
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    out = {}
    for key, path in jobs:
        model, inputs = _build()
        pm = autopar.autoparallelize(model, cluster, inputs, plan=path)
        marked = {
            int(n.rpartition("block_")[2])
            for n, m in pm.named_modules()
            if "block_" in n and hasattr(m, "recompute")
        }
        pipelined = autopar.Plan.load(path).pipeline.stages > 1
        opt = pm.optimizer(torch.optim.Adam, lr=LR)
        losses = []
        for _ in range(STEPS):
            if pipelined:
                losses.append(float(pm.step(**inputs)))
            else:
                loss = pm(**inputs).loss
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        out[key] = (losses, pm.full_state_dict(), marked)
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("partial")
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    jobs, plans = [], {}
    for i, (key, options) in enumerate(CASES.items()):
        model, inputs = _build()
        plan = autopar.plan(model, cluster, inputs, **options)
        path = tmp / f"{i}.json"
        plan.save(path)
        plans[key] = plan
        jobs.append((key, str(path)))
    return plans, run_on_ranks(_rank, 2, jobs, timeout_s=600)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(CASES))
def test_partly_recomputed_plans_train_as_one_device(world2, key):
    plans, per_rank = world2
    plan = plans[key]
    assert plan.trades.recompute_blocks == CASES[key]["recompute_blocks"]
    assert plan.pipeline.stages == CASES[key].get("pipeline_stages", 1)
    model, inputs = _build()
    ref_losses, ref_state = adam_reference(model, inputs, STEPS, LR)
    marked = set()
    for rank, results in enumerate(per_rank):
        losses, state, here = results[key]
        marked |= here
        assert losses == pytest.approx(ref_losses, rel=1e-4)  # losses near log V: relative alone
        assert set(state) == set(ref_state)
        for k, want in ref_state.items():
            assert_adam_state_close(state[k], want, LR, STEPS, f"rank {rank} {k}")
    assert marked == CHECKPOINTED[key]
