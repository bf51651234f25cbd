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
    return (
        f"{op} (node {e.dst}) has no strategy that takes {tensor} as the axis roles leave it "
        f"({' or '.join(have)}); it takes it only as {' or '.join(need) or 'nothing'}, and the roles "
        "forbid that move (a data axis never gathers a split activation; parameters and inputs keep "
        "their role's placement)"
    )
