r"""Solve: choose one strategy per node by integer linear programming (PuLP).

Variables
    x[v, s] in {0, 1}     node v takes strategy s                          (``_node_vars``)
    y[e, a, b] in [0, 1]  edge e = (u -> v) has u in a and v in b          (``_edge_vars``)

Objective (seconds per training step, per device)
    min  sum_{v,s} c[v,s] x[v,s]  +  sum_{e,a,b} c[e,a,b] y[e,a,b]

Constraints
    (1) one strategy per node:     sum_s x[v,s] = 1                         (``_node_vars``)
    (2) edge linearization:        sum_b y[e,a,b] = x[u,a],  sum_a y[e,a,b] = x[v,b]
                                                                            (``_edge_vars``)
        Edges whose source or destination has a single strategy need no y: their cost is linear
        in the other end's x and is folded into it (``_fold_edge``).
    (3) per-device memory:         sum_{v,s} m[v,s] x[v,s] + sum_{e,a,b} m[e,a,b] y[e,a,b] <= M
                                                                            (``_memory_constraint``)

(2) is the standard tight linearization of x[u,a] * x[v,b] (its LP relaxation's vertices are
integral on trees), as in Alpa (Zheng et al., OSDI 2022) and meta-pytorch/autoparallel.
The outer search tries every mesh shape (``mesh_candidates``) and keeps the best objective.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pulp

from autopar.errors import SolverError
from autopar.passes.costs import CostTables, Edge


@dataclass(frozen=True)
class Solution:
    choice: dict[str, int]  # node name -> strategy index
    objective: float
    status: str
    solve_time_s: float
    solver: str
    num_variables: int
    num_constraints: int


def mesh_candidates(world_size: int, max_axes: int = 2) -> list[tuple[int, ...]]:
    """Every factorization of world_size into 1..max_axes axes, each of size >= 2 (or (1,))."""
    if world_size == 1:
        return [(1,)]
    out: list[tuple[int, ...]] = []

    def rec(rest: int, prefix: tuple[int, ...]) -> None:
        if rest == 1:
            out.append(prefix)
            return
        if len(prefix) == max_axes:
            return
        for f in range(2, rest + 1):
            if rest % f == 0:
                rec(rest // f, prefix + (f,))

    rec(world_size, ())
    return sorted(out, key=lambda m: (len(m), m))


def solve(
    tables: CostTables, memory_limit_bytes: float, time_limit_s: float | None = None
) -> Solution | None:
    """Return the optimal choice, or None if no assignment fits ``memory_limit_bytes``."""
    t0 = time.perf_counter()
    prob = pulp.LpProblem("autopar", pulp.LpMinimize)
    x = _node_vars(prob, tables)
    lin_cost = {k: list(v) for k, v in tables.node_cost.items()}
    lin_mem = {k: list(v) for k, v in tables.node_mem.items()}
    quad: list[tuple[Edge, dict]] = []
    for e in tables.edges:
        if not _fold_edge(e, tables, lin_cost, lin_mem):
            quad.append((e, _edge_vars(prob, e, x, tables)))
    _forbid(prob, x, lin_cost)
    for e, ys in quad:
        for (a, b), y in ys.items():
            if math.isinf(e.cost[a][b]):
                y.upBound = 0
    objective = pulp.lpSum(c * x[v][s] for v, cs in lin_cost.items() for s, c in enumerate(cs) if c)
    objective += pulp.lpSum(
        e.cost[a][b] * y
        for e, ys in quad
        for (a, b), y in ys.items()
        if e.cost[a][b] and math.isfinite(e.cost[a][b])
    )
    prob += objective
    _memory_constraint(prob, x, quad, lin_mem, memory_limit_bytes)

    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s)
    try:
        prob.solve(solver)
    except pulp.PulpSolverError as e:
        raise SolverError(
            f"the ILP solver failed: {e}; check that PuLP's bundled CBC runs on this machine"
        ) from e
    status = pulp.LpStatus[prob.status]
    elapsed = time.perf_counter() - t0
    if status in ("Infeasible", "Undefined") or prob.sol_status not in (1, 2):
        return None
    choice = {}
    for v, xs in x.items():
        vals = [var if isinstance(var, int) else (var.value() or 0.0) for var in xs]
        choice[v] = max(range(len(vals)), key=lambda i: vals[i])
    return Solution(
        choice=choice,
        objective=float(pulp.value(prob.objective) or 0.0),
        status=status,
        solve_time_s=elapsed,
        solver=solver.name,
        num_variables=len(prob.variables()),
        num_constraints=len(prob.constraints),
    )


def _node_vars(prob: pulp.LpProblem, tables: CostTables) -> dict[str, list]:
    x = {}
    for i, (v, ss) in enumerate(tables.strategies.items()):
        if len(ss) == 1:
            x[v] = [1]  # constant: no variable needed
            continue
        x[v] = [pulp.LpVariable(f"x_{i}_{s}", cat=pulp.LpBinary) for s in range(len(ss))]
        prob += pulp.lpSum(x[v]) == 1, f"one_{i}"
    return x


def _fold_edge(e: Edge, tables: CostTables, lin_cost: dict, lin_mem: dict) -> bool:
    n_src, n_dst = len(tables.strategies[e.src]), _n_dst(e, tables)
    if n_src == 1:
        if e.dst == "output":
            return True  # a constant: does not change the argmin (``evaluate`` reports it)
        for b in range(n_dst):
            lin_cost[e.dst][b] += e.cost[0][b]
            lin_mem[e.dst][b] += e.mem[0][b]
        return True
    if n_dst == 1:
        for a in range(n_src):
            lin_cost[e.src][a] += e.cost[a][0]
            lin_mem[e.src][a] += e.mem[a][0]
        return True
    return False


def _forbid(prob: pulp.LpProblem, x: dict, lin_cost: dict) -> None:
    """Strategies whose folded cost is infinite (a forbidden pair) are fixed to 0."""
    for v, cs in lin_cost.items():
        for s, c in enumerate(cs):
            if math.isinf(c):
                if isinstance(x[v][s], int):
                    raise SolverError(f"node {v}: its only strategy is forbidden by the axis roles")
                prob += x[v][s] == 0, f"forbid_{v}_{s}"
                cs[s] = 0.0


def _n_dst(e: Edge, tables: CostTables) -> int:
    return 1 if e.dst == "output" else len(tables.strategies[e.dst])


def _edge_vars(prob: pulp.LpProblem, e: Edge, x: dict, tables: CostTables) -> dict:
    idx = len(prob.constraints)
    ys = {}
    n_src, n_dst = len(tables.strategies[e.src]), _n_dst(e, tables)
    for a in range(n_src):
        for b in range(n_dst):
            ys[(a, b)] = pulp.LpVariable(f"y_{idx}_{a}_{b}", lowBound=0, upBound=1)
    for a in range(n_src):
        prob += pulp.lpSum(ys[(a, b)] for b in range(n_dst)) == x[e.src][a], f"ys_{idx}_{a}"
    for b in range(n_dst):
        prob += pulp.lpSum(ys[(a, b)] for a in range(n_src)) == x[e.dst][b], f"yd_{idx}_{b}"
    return ys


def _memory_constraint(prob, x, quad, lin_mem, limit: float) -> None:
    if not math.isfinite(limit):
        return
    terms = [m * x[v][s] for v, ms in lin_mem.items() for s, m in enumerate(ms) if m]
    terms += [e.mem[a][b] * y for e, ys in quad for (a, b), y in ys.items() if e.mem[a][b]]
    prob += pulp.lpSum(terms) <= limit, "memory"


def evaluate(tables: CostTables, choice: dict[str, int]) -> tuple[float, float]:
    """(seconds, bytes) of a full assignment: the ILP objective and memory, computed directly."""
    t = sum(tables.node_cost[v][s] for v, s in choice.items())
    m = sum(tables.node_mem[v][s] for v, s in choice.items())
    for e in tables.edges:
        b = 0 if e.dst == "output" else choice[e.dst]
        t += e.cost[choice[e.src]][b]
        m += e.mem[choice[e.src]][b]
    return t, m
