"""``apply_trades`` keeps each part of its result on the tables per the trades that part reads
(``passes/trades.py``: parameters, activations, edges): every rung of the ladder, applied in the
climb's order to one candidate's tables (the parts of earlier rungs kept), gives the rows the same
trades give on a fresh copy of the tables (nothing kept), in the same order; on a CPU mesh and on a
GPU preset with mixed precision and offload among the rungs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import rung_tables

import autopar
from autopar.examples import llama, llama_tiny
from autopar.options import Optimizer
from autopar.passes.trades import apply_trades
from autopar.trades import Offload, Precision, Recompute


def _meta_llama():
    with torch.device("meta"):
        model, inputs = llama(
            layers=3, hidden=256, ffn=512, heads=4, kv_heads=2, vocab=1024, batch=16, seq=128
        )
    return model, inputs, autopar.ClusterSpec.preset("h100-sxm", devices_per_node=8), (4, 2)


CASES = {
    "llama-cpu4": lambda: (
        *llama_tiny(batch=8, seq=32),
        autopar.ClusterSpec.preset("cpu", devices_per_node=4),
        (2, 2),
    ),
    "llama-h100x8": _meta_llama,
}
ROWS = ("node_cost", "node_mem", "node_peak", "grad_mem", "step_peak")


@pytest.mark.parametrize("case", sorted(CASES))
def test_kept_parts_give_the_rows_of_fresh_tables(case):
    model, inputs, cluster, mesh = CASES[case]()
    r = rung_tables(model, inputs, cluster, mesh)
    tg, cinfos, tables, blocks, rungs, precision = r.tg, r.cinfos, r.tables, r.blocks, r.rungs, r.precision
    kinds = {(t.recompute, t.micro_batches > 1, t.offload is not Offload.NONE, t.zero_stage) for t in rungs}
    assert len(kinds) > 12 and any(t.recompute is Recompute.FULL for t in rungs)
    if case == "llama-h100x8":
        assert precision is Precision.BF16
    moved = set()
    for t in rungs:
        kept = apply_trades(tables, tg, cinfos, t, cluster, Optimizer.ADAM, blocks)
        fresh = apply_trades(dataclasses.replace(tables), tg, cinfos, t, cluster, Optimizer.ADAM, blocks)
        for f in ROWS:
            assert list(getattr(kept, f).items()) == list(getattr(fresh, f).items()), (t.describe(), f)
        assert kept.edges == fresh.edges, t.describe()
        moved.add(sum(sum(r) for r in kept.node_mem.values()))
    assert len(moved) > 8  # the rungs' rows differ: each part was keyed by what it reads
