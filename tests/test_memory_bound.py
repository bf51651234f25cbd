"""The memory lower bound the trades ladder asks of every rung (``passes/memory_row.py:
lower_bound_bytes``, numpy over a layout kept per positions map) is the float its loop over the
terms gives (``lower_bound_bytes_loop``), bit for bit, on every rung of real tables: coarsened
repeated blocks (terms spread over several positions), gradients, transients, edges to the output;
and again on a pipeline stage's rows, which share the tables' positions but not their edges."""

from __future__ import annotations

import pytest
from harness import rung_tables

import autopar
from autopar.examples import gpt2_tiny, llama_tiny
from autopar.options import Optimizer
from autopar.passes.memory_row import lower_bound_bytes, lower_bound_bytes_loop
from autopar.passes.pipeline import Regions, stage_tables
from autopar.passes.trades import apply_trades, traded_lower_bound

CASES = {
    "llama-cpu4": lambda: (
        *llama_tiny(batch=8, seq=32),
        autopar.ClusterSpec.preset("cpu", devices_per_node=4),
        (2, 2),
    ),
    "gpt2-cpu2": lambda: (
        *gpt2_tiny(batch=8, seq=32),
        autopar.ClusterSpec.preset("cpu", devices_per_node=2),
        (2,),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bound_is_the_loops_float_on_every_rung(case):
    model, inputs, cluster, mesh = CASES[case]()
    r = rung_tables(model, inputs, cluster, mesh)
    tg, cinfos, tables, blocks, rungs = r.tg, r.cinfos, r.tables, r.blocks, r.rungs
    assert any(len(m) > 1 for m in r.classes.members.values())  # terms spread over several positions
    regions = Regions.of(tg, blocks)
    assert len(rungs) > 10
    seen = set()
    for t in rungs:
        traded = apply_trades(tables, tg, cinfos, t, cluster, Optimizer.ADAM, blocks)
        for rows in (traded, stage_tables(traded, cinfos, regions, 2, 2)):
            got, want = lower_bound_bytes(rows), lower_bound_bytes_loop(rows)
            assert got == want, (t.describe(), got, want)
            seen.add(want)
        fast = traded_lower_bound(tables, cinfos, t, cluster, Optimizer.ADAM, blocks)
        assert fast == lower_bound_bytes_loop(traded), (t.describe(), fast)
    assert len(seen) > 5  # the rungs' bounds differ: the terms moved
