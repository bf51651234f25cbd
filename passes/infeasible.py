"""Why a candidate has no plan whatever the memory: the op its axis roles leave no strategy.

The solver's tables forbid a resharding pair with an infinite price (``passes/costs.py``: a data
axis never gathers a split activation, a role's pinned placeholders never move). Where those
forbidden pairs alone leave some node no strategy, the ILP is infeasible at any memory limit and
"no plan fits" would blame memory. ``blocked`` finds the node by arc consistency: a strategy of a
node stays only while every edge into or out of it has a finite pair with a strategy still left at
the other end; the first node left with none is named, with the tensor whose placements it could not
take, so the error says which op stops the roles.
"""

from __future__ import annotations

import math

import torch.fx as fx

from autopar.passes.costs import CostTables
from autopar.passes.strategies import written_in_place
from autopar.placement import spec_to_str


def blocked(tables: CostTables, nodes: dict[str, fx.Node]) -> str | None:
    """The reason no strategy choice exists under the tables' forbidden pairs, naming the op; None
    where every node keeps a strategy (the problem is then feasible but for memory)."""
    alive = {v: set(range(len(s))) for v, s in tables.strategies.items()}
    edges = [e for e in tables.edges if e.src in alive and e.dst in alive]
    changed = True
    while changed:
        changed = False
        for e in edges:
            src, dst = alive[e.src], alive[e.dst]
            keep_src = {i for i in src if any(e.cost[i][j] < math.inf for j in dst)}
            keep_dst = {j for j in dst if any(e.cost[i][j] < math.inf for i in src)}
            if keep_src == src and keep_dst == dst:
                continue
            if not keep_dst or not keep_src:
                return _reason(tables, e, src, dst, nodes)
            alive[e.src], alive[e.dst] = keep_src, keep_dst
            changed = True
    return None


def _reason(tables: CostTables, e, src: set[int], dst: set[int], nodes: dict[str, fx.Node]) -> str:
    node = nodes.get(e.dst)
    op = str(node.target) if node is not None and node.op == "call_function" else e.dst
    have = sorted({spec_to_str(tables.strategies[e.src][i].out) for i in src})
    tensor = e.tensor or e.src
    need = sorted({spec_to_str(e.need[j][0]) for j in dst}) if e.need else []
    written = _written(node)
    if written is not None:
        writer, reader = written
        return (
            f"{writer.target} (node {writer.name}) writes in place into {e.dst}, which "
            f"{reader.target} (node {reader.name}) reads after the write: {op} (node {e.dst}) and the "
            f"in-place op must take {tensor} as it is stored (a reshard would copy the value and lose "
            f"the write), and {op} has no strategy that takes it as the axis roles leave it "
            f"({' or '.join(have)}), only as {' or '.join(need) or 'nothing'}; the roles forbid that "
            "move (a data axis never gathers a split activation); write it out of place "
            "(`y = x.mul(s)`, not `x.mul_(s)`)"
        )
    return (
        f"{op} (node {e.dst}) has no strategy that takes {tensor} as the axis roles leave it "
        f"({' or '.join(have)}); it takes it only as {' or '.join(need) or 'nothing'}, and the roles "
        "forbid that move (a data axis never gathers a split activation; parameters and inputs keep "
        "their role's placement)"
    )


def _written(node: fx.Node | None) -> tuple[fx.Node, fx.Node] | None:
    """(the in-place op, an op that sees its write) where ``node`` takes its input as stored because
    an in-place op writes into it (``strategies.mutated_views``, ``takes_as_stored``) or is that
    op; else None."""
    if node is None or node.op != "call_function":
        return None
    written = written_in_place(node.graph)
    if node.name in written:
        return written[node.name]
    return next(
        (written[a.name] for a in node.all_input_nodes if written.get(a.name, (None,))[0] is node), None
    )
