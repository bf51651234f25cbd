"""The search's table memos (``passes/costs.py:build_costs``'s ``memos``, ``Problem.table_memos``)
change no table: candidates of one mesh under other axis roles, built one after the other on one
memo, equal each table built alone; with the repeated layers coarsened into classes (the graph's
layout, ``costs.graph_layout``, then built once) as without."""

from __future__ import annotations

import pytest

import autopar
from autopar import AxisRole, Optimizer, examples
from autopar.passes.analyze import analyze
from autopar.passes.coarsen import find_classes
from autopar.passes.costs import CostTables, build_costs
from autopar.passes.strategies import build_strategies, variable_nodes
from autopar.passes.trace import trace


def _rows(t: CostTables) -> tuple:
    edges = [
        (e.src, e.dst, e.cost, e.mem, e.peak, e.keep, e.copy, e.bucketed, e.have, e.need) for e in t.edges
    ]
    return (
        t.strategies, t.node_cost, t.node_mem, t.node_peak, t.keep_positions, t.bucket_fixed, edges,
        t.positions, t.step_position, t.grad_mem, t.grad_free, t.step_peak,
    )  # fmt: skip


@pytest.mark.parametrize("coarsened", [False, True])
def test_tables_built_on_one_memo_equal_each_built_alone(coarsened):
    model, inputs = examples.moe_tiny("deepseek_v3", batch=8, experts=8)
    tg = trace(model, inputs)
    infos = analyze(tg)
    classes = find_classes(tg, infos, variable_nodes(tg)) if coarsened else None
    if coarsened:  # the layers repeat: some class has two members or more
        assert len(classes.members) < len(classes.rep)
    only = set(classes.members) if coarsened else None
    cluster = autopar.ClusterSpec.preset("h100-sxm", 1, 8)
    memos: dict = {}
    cases = [
        ((8,), (AxisRole.DATA,)),
        ((8,), (AxisRole.EXPERT,)),  # the expert axis splits the batch too: data axes (0,) again
        ((2, 4), (AxisRole.DATA, AxisRole.AUTO)),
        ((2, 4), (AxisRole.EXPERT, AxisRole.AUTO)),
        ((2, 4), (AxisRole.DATA, AxisRole.EXPERT)),  # data axes (0, 1): pairs of its own
    ]
    for mesh, roles in cases:
        strats = build_strategies(tg, infos, mesh, roles, only=only)
        shared = build_costs(tg, infos, strats, cluster, mesh, Optimizer.ADAM, roles, classes, memos=memos)
        alone = build_costs(tg, infos, strats, cluster, mesh, Optimizer.ADAM, roles, classes)
        assert _rows(shared) == _rows(alone), (mesh, roles)
    # the graph's analyses once, and one memo of pairs per cluster, mesh and data axes: the second
    # case took the first's, the fourth the third's
    assert sum(k[0] == "kept" for k in memos) == 1 and sum(k[0] == "uses" for k in memos) == 1
    assert sum(k[0] == "layout" for k in memos) == (1 if coarsened else 0)  # made per call without classes
    edges = [k[2:] for k in memos if k[0] == "edges"]
    assert sorted(edges) == [((2, 4), (0,)), ((2, 4), (0, 1)), ((8,), (0,))]
    assert all(m for k, m in memos.items() if k[0] == "edges")  # each memo holds its pairs
