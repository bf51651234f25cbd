r"""Solve: choose one strategy per node by integer linear programming (HiGHS; CBC without it).

Variables
    x[v, s] in {0, 1}     node v takes strategy s                          (``_node_vars``)
    y[e, a, b] in [0, 1]  edge e = (u -> v) has u in a and v in b          (``_edge_vars``)

    z[t, k] in [0, 1]     the reshard k = (have, need, "f" axes) of tensor t runs   (``_sharing_groups``)

Objective (seconds per training step, per device)
    min  sum_{v,s} c[v,s] x[v,s]  +  sum_{e,a,b} c[e,a,b] y[e,a,b]  +  sum_{t,k} c[t,k] z[t,k]

    where the edges of a tensor t with two or more consumers (q, k and v of one input) leave the
    pairs that reshard (``Edge.share_key``) out of the y sum: ``z[t,k] >= y[e,a,b]`` for every
    such pair of every such edge, so the reshard is paid once however many consumers take it, as
    codegen runs it once (``passes/grad_sync.py:reshard_key``). Edges folded into a node's cost
    (an end with one strategy, a folded follower) are paid per edge.

    + sum_a b[a] g[a]: a parameter's gradient all-reduce deferred to a bucket on mesh axis a is
    priced on its pair as its share of the bucket (``use_price.use_price``), and the bucket's fixed
    part ``b[a]`` (``CostTables.bucket_fixed``) once: ``g[a] >= [pair chosen]`` for every such
    pair, linearized over the folded problem's variables (``_bucket_rows``).

Constraints
    (1) one strategy per node:     sum_s x[v,s] = 1                         (``_node_vars``)
    (2) edge linearization:        sum_b y[e,a,b] = x[u,a],  sum_a y[e,a,b] = x[v,b]
                                                                            (``_edge_vars``)
        over groups: strategies of u whose rows of (c[e], m[e]) are identical form one group A
        (likewise columns of v, group B); y[e,A,B] with sum_B y[e,A,B] = sum_{a in A} x[u,a] and
        sum_A y[e,A,B] = sum_{b in B} x[v,b]. Exact for integral x (one group on each side sums
        to 1, so y[e,A,B] = 1 for exactly that pair), with far fewer y: strategies that differ
        elsewhere usually reshard a given tensor alike.
        Edges whose source or destination has a single strategy need no y: their cost is linear
        in the other end's x and is folded into it (``_fold_edge``).
    (3) per-device memory, from liveness: at every position p (graph order) where a transient can
        set the peak, S(p) + z_p <= M, and S(end) <= M, with
            S(p) = sum of m[v,s] x[v,s], m[e,a,b] y[e,a,b] and K_o charged at positions <= p
                   (a node's bytes at its members' positions, an edge's at its source's),
            z_p >= sum_s p[v,s] x[v,s]  for every transient at p (a node's backward, or the same
                   over y for a reshard's collectives), and each storage o that several consumers
                   keep as it is counted once, K_o >= sum_{a,b} k[e,a,b] y[e,a,b] for each keeper e
                                                            (``memory_row.add_memory_rows``)

(2) is the standard tight linearization of x[u,a] * x[v,b] (its LP relaxation's vertices are
integral on trees), as in Alpa (Zheng et al., OSDI 2022) and meta-pytorch/autoparallel.
Before the ILP, followers are folded into their producers (``fold_followers``), which
removes most edges of a transformer block. When the folded ILP has no plan under M, the LP
relaxation of the unfolded one is solved first: if even it is infeasible, so is the ILP (a cheap
proof; the unfolded ILP runs only otherwise). The model is built as arrays (``passes/lp_model.py``) and
passed to HiGHS whole. Given a cutoff (the search's best step so far), the ILP's own LP relaxation
runs first: where its optimum passes the cutoff, only whether the ILP has a plan is found out
(``Pruned``), not its optimum. The outer search (``autopar.api.search``) tries every
mesh shape (``mesh_candidates``: 1, 2 and 3 axes; a 3-axis mesh's outer axis data parallel) and
keeps the best objective.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autopar.errors import SolverError
from autopar.passes.costs import CostTables, Edge
from autopar.passes.lp_model import Model, Var, highs_available
from autopar.passes.memory_row import Folds, add_memory_rows, lower_bound_bytes, peak_bytes
from autopar.passes.strategies import Strategy

# the tables with followers folded in, and each follower with its producer and best responses
Folded = tuple[CostTables, list[tuple[str, tuple[str, list[int]]]]]


@dataclass(frozen=True)
class Solution:
    choice: dict[str, int]  # node name -> strategy index
    objective: float
    status: str
    solve_time_s: float
    solver: str
    num_variables: int
    num_constraints: int
    # where the node limit (``MIP_NODE_LIMIT``) stopped the ILP: the least objective [s] its tree
    # proved for any plan of these tables (-inf: stopped before its root's bound); None: solved
    bound: float | None = None


def node_aligned(mesh: tuple[int, ...], devices_per_node: int) -> bool:
    """Every axis lies inside a node or strictly across nodes: the fast (last) axes tile a node.

    Axis a (row-major, stride = product of the later axes) spans ``stride * size`` ranks: it is
    intra-node when that span fits in a node, inter-node when its stride is a whole number of
    nodes. Anything else mixes links inside one collective and is left out of the search."""
    stride = 1
    for n in reversed(mesh):
        span = stride * n
        if not (span <= devices_per_node and devices_per_node % span == 0) and stride % devices_per_node:
            return False
        stride = span
    return True


def mesh_candidates(
    world_size: int, max_axes: int = 2, devices_per_node: int | None = None
) -> list[tuple[int, ...]]:
    """Every factorization of world_size into 1..max_axes axes, each of size >= 2 (or (1,)),
    kept only if node-aligned when ``devices_per_node`` is given."""
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
    if devices_per_node:  # the 1-D mesh stays: plain data parallelism over everything, priced inter-node
        out = [m for m in out if len(m) == 1 or node_aligned(m, devices_per_node)]
    return sorted(out, key=lambda m: (len(m), m))


def lower_bound(tables: CostTables, folded: Folded | None = None) -> float:
    """A lower bound on the step time of the plans the solver searches on these tables: every
    node (followers folded in) at its cheapest strategy, every edge at its cheapest pair, each
    chosen independently. An edge's cheapest pair is often > 0: e.g. a replicated weight's gradient
    all-reduce over a data-parallel axis, which every pair pays. Used to prune meshes and to report
    a gap. ``folded``: ``fold_followers(tables, exact=True)``, if at hand: exact folding keeps
    every plan's price, so the bound holds for the unfolded problem. (A follower folded to a
    heuristic response would not do: its re-rowed out-edges can cost more than the real optimum's.)"""
    reduced, _ = folded or fold_followers(tables, exact=True)
    nodes = sum(min(c) for c in reduced.node_cost.values())
    return nodes + sum(min(min(row) for row in e.cost) for e in reduced.edges)


class Proof(enum.Enum):
    """What proved a solve ``Pruned``."""

    LP = "LP relaxation"  # its LP relaxation's optimum (``Pruned.bound``) passes the cutoff
    ILP = "ILP"  # the ILP run with the cutoff as its objective bound had no plan under it


@dataclass(frozen=True)
class Pruned:
    """A solve cut short by its ``cutoff``: the ILP has a plan, and ``bound`` [s], a lower bound on
    every plan's objective (its LP relaxation's optimum, or the cutoff where the ILP found none
    under it), is already above the cutoff, so its optimum is too."""

    bound: float
    solve_time_s: float
    by: Proof = Proof.LP  # what proved it


# an LP relaxation's optimum must pass the cutoff by this much (relative) to prune: HiGHS meets
# its rows within 1e-7, so a bound that equals the cutoff is no proof
PRUNE_RTOL = 1e-6
# branch-and-bound nodes per ILP (HiGHS's ``mip_max_nodes``): a bound on the work, not the seconds,
# so the same inputs stop at the same place under any load. Where it stops an ILP, its best plan so
# far is taken (or, with none, the first plan on its rows alone: ``Model.first_solution``) and the
# plan records what was not explored: the plans between the tree's bound and the one taken
# (``Solution.bound``, the candidate's ``ilp_bound``, ``SolverInfo.node_limit_line``). Far above
# what the search's ILPs take: each of benchmarks/plan_snapshot.py's 151 MIP solves closed at its
# root node (2026-11-28), so it cuts only a tree gone astray, and says so
MIP_NODE_LIMIT = 1_000
# the LP relaxation is solved by the interior point method where the memory lower bound is at least
# this share of the limit (the memory rows likely bind), after a dual simplex capped by its work
# (lp_model.Model.relaxation); by the dual simplex alone below it
IPM_MEMORY_SHARE = 0.25


def memory_binds(tables: CostTables, memory_limit_bytes: float) -> bool:
    """Whether the memory rows likely bind: the memory lower bound is at least ``IPM_MEMORY_SHARE``
    of the limit (the LP relaxation is then solved by the interior point method, and the search
    solves the free candidates after the data-parallel ones: ``passes/search.py:explore``)."""
    return lower_bound_bytes(tables) >= IPM_MEMORY_SHARE * memory_limit_bytes


def solve(
    tables: CostTables,
    memory_limit_bytes: float,
    time_limit_s: float | None = None,
    merge_followers: bool = True,
    folded: Folded | None = None,
    cutoff: float = math.inf,
    hints: Sequence[Mapping[str, Strategy]] = (),
) -> Solution | Pruned | None:
    """Return the best choice, or None if no assignment fits ``memory_limit_bytes``.

    With ``merge_followers`` (see ``fold_followers``) the ILP is smaller and the result optimal over
    the plans in which every follower answers its producer as cheaply as it can; without, optimal.

    ``cutoff`` [s] (HiGHS only): where the ILP has a plan but its LP relaxation already proves its
    optimum above the cutoff, ``Pruned`` instead of the optimum (the search passes its best step so
    far: such a candidate cannot beat it). The relaxation costs a tenth of the ILP on a large
    mesh (benchmarks/README.md, "Planning time at scale"); whether there is a plan at all is
    still decided (its first solution found), so what a candidate with no plan gets is unchanged.
    ``hints``: plans (node -> strategy) the search found for another candidate on the same mesh,
    tried as that first solution where they are plans of these tables (``_solve``)."""
    sol = None
    if merge_followers:
        reduced, merged = folded or fold_followers(tables)
        sol = _solve(
            reduced,
            memory_limit_bytes,
            time_limit_s,
            buckets=_bucket_rows(tables, reduced, merged),
            cutoff=cutoff,
            hints=hints,
        )
        if isinstance(sol, Pruned):
            return sol
        if sol is not None:
            choice = dict(sol.choice)
            for v, (u, response) in reversed(merged):
                choice[v] = response[choice[u]]
            sol = dataclasses.replace(sol, choice=choice)
    if (
        sol is None
        and merge_followers
        and _solve(tables, memory_limit_bytes, time_limit_s, relax=True) is None
    ):
        return None  # not even the LP relaxation of the full problem fits: proven infeasible, cheaply
    if sol is None:
        sol = _solve(tables, memory_limit_bytes, time_limit_s, buckets=_bucket_rows(tables, tables))
    if sol is None:
        return None
    # the ILP's objective leaves out constants (single-strategy nodes, graph outputs): report the full price
    return dataclasses.replace(sol, objective=objective_s(tables, sol.choice))


# the search folds only dominant followers (exact) up to this many edge strategy pairs, every
# follower (heuristic) above. The heuristic fold fixes a follower's answer before its consumers
# choose, and that loses plan quality: GPT-2 small on 8 H100s (23,642 pairs on 2 x 4) plans at
# 40.5 ms per step with it, 29.8 ms exactly; llama_tiny's automatic plan on a 2 x 2 cpu mesh
# (~60,000 pairs) at 12.45 ms, 7.68 ms exactly. With the ILP passed to HiGHS whole
# (passes/lp_model.py) and candidates pruned by their LP relaxation, exact folding costs no
# planning time at scale: Llama-3-8B on 64 H100s plans in 29.0 s (33.3 s with the heuristic fold
# above 30,000 pairs), the 70B on 1024 in 62.1 s (64.1 s), the same plans (measured on the 2-core
# dev VM, 2026-11-26: benchmarks/README.md, "Planning time at scale"). Exact folding is used for
# the lower bound in any case (a heuristic fold gives no valid bound). The heuristic stays for
# tables past this many pairs.
EXACT_FOLD_MAX_PAIRS = 3_000_000


def edge_pairs(tables: CostTables) -> int:
    """Strategy pairs over the edges whose two ends both have a choice: the unfolded ILP's size."""
    n = {v: len(s) for v, s in tables.strategies.items()}
    return sum(
        n[e.src] * n[e.dst] for e in tables.edges if e.dst != "output" and n[e.src] > 1 and n[e.dst] > 1
    )


def fold_followers(tables: CostTables, exact: bool | None = None) -> Folded:
    r"""Merge *followers* into their producers: a node v whose only input with a choice comes from
    one producer u (views, unary elementwise ops, softmax, ...). For each strategy a of u, v takes
    a response ``b*(a)``; v's costs move into u's (``c[u, a] += c[u->v, a, b*(a)] + c[v, b*(a)]``,
    the same for memory) and v's out-edges start from u with rows ``b*(a)``. Repeated until no
    follower is left: chains of views collapse.

    ``exact`` (the default when the tables have at most ``EXACT_FOLD_MAX_PAIRS`` edge pairs; see there): fold
    v only if, for every a, one response is best whatever v's consumers choose
    (``_dominant_responses``); the folded ILP then has the unfolded one's optimum. Otherwise every
    follower is folded to its cheapest response counting the least its consumers pay
    (``_best_responses``): much smaller ILPs, optimal only over the plans where followers answer
    that way (on small models this lost up to 40%, hence exact where affordable)."""
    if exact is None:
        exact = edge_pairs(tables) <= EXACT_FOLD_MAX_PAIRS
    strategies = dict(tables.strategies)
    cost = {k: list(v) for k, v in tables.node_cost.items()}
    mem = {k: list(v) for k, v in tables.node_mem.items()}
    shared = Folds.of(tables)
    edges = list(tables.edges)
    merged: list[tuple[str, tuple[str, list[int]]]] = []
    rejected: set[str] = set()  # followers whose best response depends on their consumers' choice
    while True:
        # fold constant sources and self-loops into node costs, then look for a follower
        sources: dict[str, set[str]] = {}
        kept = []
        # each node's edges in and out, in the order of ``edges``: what a scan of ``edges`` for
        # one node's would give, found once per fold instead of once per node looked at
        ins: dict[str, list[Edge]] = {}
        outs: dict[str, list[Edge]] = {}
        for e in edges:
            if e.dst != "output" and (e.src == e.dst or len(strategies[e.src]) == 1):
                for b in range(len(strategies[e.dst])):
                    a = b if e.src == e.dst else 0
                    cost[e.dst][b] += e.cost[a][b]
                    mem[e.dst][b] += e.mem[a][b]
                    shared.absorb_edge(tables, e, a, b, e.dst, b, len(strategies[e.dst]))
                continue
            kept.append(e)
            ins.setdefault(e.dst, []).append(e)
            outs.setdefault(e.src, []).append(e)  # no self-loop is left: folded just above
            if e.dst != "output":
                sources.setdefault(e.dst, set()).add(e.src)
        edges = kept
        v, response = None, None
        for cand, srcs in sources.items():
            if len(srcs) != 1 or len(strategies[cand]) == 1 or cand in rejected:
                continue
            (u,) = srcs
            respond = _dominant_responses if exact else _best_responses
            response = respond(ins.get(cand, []), outs.get(cand, []), cost[cand], len(strategies[u]))
            if response is not None:
                v = cand
                break
            rejected.add(cand)
        if v is None:
            break
        into = ins.get(v, [])
        nu = len(strategies[u])
        for a, b in enumerate(response):
            cost[u][a] += sum(e.cost[a][b] for e in into) + cost[v][b]
            mem[u][a] += sum(e.mem[a][b] for e in into) + mem[v][b]
            for e in into:  # transients and shared storages do not add up: the largest counts
                shared.absorb_edge(tables, e, a, b, u, a, nu)
            shared.absorb_node(v, b, u, a, nu)
        edges = [e.rows(u, response) if e.src == v else e for e in edges if e.dst != v]
        merged.append((v, (u, response)))
        del strategies[v], cost[v], mem[v]
        shared.drop(v)
    reduced = CostTables(
        tables.mesh_shape, strategies, cost, mem, edges, tables.classes, {}, shared.keep, tables.positions,
        shared.peak, tables.keep_positions, shared.mem,
        grad_mem={v: g for v, g in tables.grad_mem.items() if v in strategies},
        grad_free={v: f for v, f in tables.grad_free.items() if v in strategies},
        bucket_fixed=tables.bucket_fixed,
        float8=tables.float8,  # by node and strategy index, which folding keeps
    )  # fmt: skip
    return reduced, merged


def _best_responses(into: list[Edge], out: list[Edge], v_cost: list[float], na: int) -> list[int]:
    """For each strategy a of the producer, v's cheapest response counting what its consumers pay
    at least to take its output (their own choices still open): a heuristic, see fold_followers.
    ``into``, ``out``: v's edges in and out (a self-loop in neither)."""
    nb = len(v_cost)
    ahead = [sum(min(e.cost[b]) for e in out) for b in range(nb)]
    return [
        min(range(nb), key=lambda b: sum(e.cost[a][b] for e in into) + v_cost[b] + ahead[b])
        for a in range(na)
    ]


def edge_regret(c: np.ndarray) -> np.ndarray:
    """``[b, b']``: the most taking row ``b`` of an edge's costs ``c`` rather than row ``b'`` can
    cost, ``max_c (c[b, c] - c[b', c])``, inf - inf (both forbidden) counted as no difference.
    Rows that are bit for bit the same (the strategies of one output placement) give the same
    entries, so the ``nb x nb x nc`` differences are taken over the distinct rows only and spread
    back: the same floats as over every row, at a fraction of the work (an edge's rows repeat
    several times over where many strategies share an output placement)."""
    first: dict[bytes, int] = {}
    which = [first.setdefault(row.tobytes(), len(first)) for row in c]
    distinct = len(first) < len(c)
    u = c[_firsts(which)] if distinct else c
    with np.errstate(invalid="ignore"):
        d = u[:, None, :] - u[None, :, :]
    d = np.where(np.isnan(d), 0.0, d)  # inf - inf: both forbidden, no difference
    r = d.max(axis=2)
    if distinct:
        ix = np.asarray(which, dtype=np.intp)
        r = r[np.ix_(ix, ix)]
    return r


def _firsts(which: list[int]) -> list[int]:
    """The row that first has each distinct id of ``which`` (ids numbered in order of appearance)."""
    out: list[int] = []
    for k, w in enumerate(which):
        if w == len(out):
            out.append(k)
    return out


def _dominant_responses(into: list[Edge], out: list[Edge], v_cost: list[float], na: int) -> list[int] | None:
    """For each strategy a of v's producer u, the response b of v that is best whatever v's consumers
    choose: ``t[a, b] + sum_e max_c (c[e, b, c] - c[e, b', c]) <= t[a, b']`` for every b', with
    ``t[a, b] = c[u->v, a, b] + c[v, b]``. None if some a has no such b: then v stays a variable
    (folding it would fix a choice that depends on the consumers, and lose optimality). ``into``,
    ``out``: v's edges in and out, in the tables' order (a self-loop in neither)."""
    nb = len(v_cost)
    t = np.asarray(v_cost, dtype=float)[None, :].repeat(na, axis=0)
    for e in into:
        t = t + np.asarray(e.cost, dtype=float)
    regret = np.zeros((nb, nb))  # [b, b']: the most choosing b over b' can cost downstream
    for e in out:
        with np.errstate(invalid="ignore"):
            regret = regret + edge_regret(np.asarray(e.cost, dtype=float))
        # -inf + inf: b' forbidden downstream on one edge, b on another; as if b cost the most
        regret = np.where(np.isnan(regret), np.inf, regret)
    response = []
    worst = regret.max(axis=1)  # [b]: the most choosing b can cost downstream against any b'
    for a in range(na):
        row = t[a]
        if not np.isfinite(row).any():
            response.append(0)
            continue
        # a response the producer's strategy forbids (inf) is never best where another is allowed
        score = np.where(np.isfinite(row), row + worst, np.inf)
        if not np.isfinite(score).any():
            return None  # every allowed response may be forbidden downstream: leave v to the ILP
        best = int(np.argmin(score))
        with np.errstate(invalid="ignore"):
            slack = row[best] + regret[best] - row
        slack = np.where(np.isnan(slack), 0.0, slack)
        if (slack > 1e-12 * max(1.0, abs(row[best]))).any():
            return None
        response.append(best)
    return response


def _solve(
    tables: CostTables,
    memory_limit_bytes: float,
    time_limit_s: float | None,
    relax: bool = False,
    buckets: list[BucketRow] = (),
    cutoff: float = math.inf,
    hints: Sequence[Mapping[str, Strategy]] = (),
) -> Solution | Pruned | None:
    """The ILP on ``tables``; with ``relax``, its LP relaxation (x continuous in [0, 1]), whose
    infeasibility proves the ILP's. ``buckets``: ``_bucket_rows`` (without them the relaxation
    is still a valid proof of infeasibility: they only add cost). ``cutoff``: see ``solve``; the
    model's objective (with its constant) is at most ``objective_s`` of any plan (reshards shared
    by several uses are paid once, constant outputs not at all), so a relaxation above the cutoff
    bounds the plan's full price too."""
    t0 = time.perf_counter()
    prob = Model()
    x = _node_vars(prob, tables, integer=not relax)
    lin_cost = {k: list(v) for k, v in tables.node_cost.items()}
    shared = Folds.of(tables)
    quad: list[tuple[Edge, dict]] = []
    kept = [e for e in tables.edges if not _fold_edge(e, tables, lin_cost, shared)]
    sharing = _sharing_groups(kept)
    for e in kept:
        quad.append((e, _edge_vars(prob, e, x, tables, by_key=id(e) in sharing)))
    _forbid(prob, x, lin_cost)
    for e, ys in quad:
        for (a, b), y in ys.items():
            if math.isinf(e.cost[a][b]):
                prob.set_upper(y, 0)
    objective = [(x[v][s], c) for v, cs in lin_cost.items() for s, c in enumerate(cs) if c]
    z: dict[tuple, tuple[Var, float]] = {}  # (group, key) -> (z, cost of one reshard)
    ids: dict = {}  # placement -> a number: keys compared as Edge.share_key's, hashed once each
    for e, ys in quad:
        group = sharing.get(id(e))
        key = _share_keys(e, ids) if group is not None else None
        for (a, b), y in ys.items():
            c = e.cost[a][b]
            if not c or not math.isfinite(c):
                continue
            k = key(a, b) if key is not None else None
            if k is None:
                objective.append((y, c))
                continue
            # z >= y for every edge of the tensor that runs this reshard: paid once, at the max
            k = (group, k)
            if k not in z:
                z[k] = (prob.var(f"z_{len(z)}", 0, 1), c)
            var, c0 = z[k]
            z[k] = (var, max(c0, c))
            prob.row_distinct([var, y], [1.0, -1.0], 0.0, math.inf)
    objective += list(z.values())
    g: dict[int, Var] = {}  # axis -> a bucket's fixed price is paid there
    for axis, coef, const in buckets:
        if axis not in g:
            g[axis] = prob.var(f"g_{axis}", 0, 1)
            objective.append((g[axis], tables.bucket_fixed[axis]))
        prob.ge([(g[axis], 1.0)] + [(x[v][i], -c) for (v, i), c in coef.items()], const)
    prob.objective(objective)
    add_memory_rows(prob, x, quad, memory_limit_bytes, shared, tables)

    name = solver_name()
    objective_bound = None  # the MIP's cutoff (HiGHS's objective_bound), where memory binds
    binds = name == "HiGHS" and memory_binds(tables, memory_limit_bytes)
    # the relaxation runs first where there is a cutoff to test, and where memory binds even
    # without one: there HiGHS's MIP starts from its own root relaxation by the dual simplex, which
    # took 527 s to prove one DeepSeek-V3 candidate on 1,024 H100 infeasible (25,613 columns, the
    # first candidate of its mesh: no cutoff yet). Read only for its status there, it runs the
    # interior point method alone (``Model.relaxation``'s ``status_only``: 0.8 s on that model)
    if name == "HiGHS" and not relax and (math.isfinite(cutoff) or binds):
        lp = prob.relaxation(time_limit_s, ipm=binds, status_only=not math.isfinite(cutoff))
        if lp.status == "Infeasible":
            return None  # no fractional plan fits: nor does an integral one
        if binds and math.isfinite(cutoff):
            objective_bound = cutoff + PRUNE_RTOL * abs(cutoff)
        if lp.has_solution and lp.objective > cutoff + PRUNE_RTOL * abs(cutoff):
            # a plan at hand: the relaxation's own when integral, else its largest x per node
            # rounded to 1 where the rest of the model (continuous) still fits, else the leanest
            # strategy the relaxation uses at each node (where memory is short, the largest x
            # often passes it: this one saved both of the 8B-on-64 plan's first solutions, 0.25 s
            # each), else a plan of another candidate on this mesh (``hints``: a data-parallel
            # plan is one of the free candidate's; the DeepSeek-V3-style model's free 2 x 2
            # candidate under a memory limit, 3.6 s of CPU in HiGHS's first solution), else HiGHS's
            if prob.integral(lp.values) or _has_plan(prob, x, tables, hints, time_limit_s, lp.values):
                return Pruned(lp.objective, time.perf_counter() - t0)
            return None  # infeasible, or no plan within the time limit: as the full solve would say
    if relax and name == "HiGHS":  # only whether a fractional plan fits
        got = prob.relaxation(time_limit_s, ipm=binds, status_only=True)
        if got.status != "Infeasible" and not got.has_solution:  # not proven: the caller solves on
            return Solution({}, math.nan, got.status, time.perf_counter() - t0, got.solver, 0, 0)
    else:
        # where memory binds (the slow MIPs), the cutoff is HiGHS's objective bound: its tree drops
        # every node whose bound passes it, so it gives the optimum where that is under the cutoff,
        # else nothing under it (DeepSeek-V3 on 2,048 H100: a free (256, 8) rung whose relaxation
        # passed under the best and whose optimum did not, 10 s of branch and bound, then its
        # re-solve under the full peak). Elsewhere the MIP runs without: a different path through
        # the tree may take another of equal optima, and those searches are quick
        got = prob.solve(name, time_limit_s, node_limit=MIP_NODE_LIMIT, objective_bound=objective_bound)
    if (
        objective_bound is not None
        and not got.node_limited
        and (not got.has_solution or got.objective > objective_bound)
    ):
        if got.has_solution or _has_plan(prob, x, tables, hints, time_limit_s):
            return Pruned(objective_bound, time.perf_counter() - t0, by=Proof.ILP)
        return None
    if got.node_limited and not got.has_solution:  # any plan at all, on the rows alone
        first = prob.first_solution(time_limit_s)
        got = dataclasses.replace(first, node_limited=True, bound=got.bound)
    elapsed = time.perf_counter() - t0
    if got.status in ("Infeasible", "Undefined") or not got.has_solution:
        return None
    choice = {}
    for v, xs in x.items():
        vals = [var if isinstance(var, int) else got.values[var.index] for var in xs]
        choice[v] = max(range(len(vals)), key=lambda i: vals[i])
    return Solution(
        choice=choice,
        objective=got.objective,
        status="Feasible (node limit)"
        if got.node_limited
        else "Feasible (time limit)"
        if got.time_limited
        else got.status,
        solve_time_s=elapsed,
        solver=got.solver,
        num_variables=prob.num_variables,
        num_constraints=prob.num_constraints,
        bound=got.bound if got.node_limited else None,
    )


def _rounded(x: dict[str, list], values, mem: dict[str, list[float]] | None = None) -> dict[int, float]:
    """Each node's strategy of largest value in a relaxation's ``values`` at 1, the others at 0
    (column index -> value); with ``mem`` (bytes per node and strategy, ``CostTables.node_mem``),
    of the strategies with a value, the one that keeps the fewest bytes."""
    out: dict[int, float] = {}
    for v, xs in x.items():
        if isinstance(xs[0], int):
            continue
        if mem is None:
            best = max(range(len(xs)), key=lambda i: values[xs[i].index])
        else:
            used = [i for i in range(len(xs)) if values[xs[i].index] > 1e-9] or list(range(len(xs)))
            best = min(used, key=lambda i: mem[v][i])
        out.update((var.index, float(i == best)) for i, var in enumerate(xs))
    return out


def _has_plan(
    prob: Model,
    x: dict[str, list],
    tables: CostTables,
    hints: Sequence[Mapping[str, Strategy]],
    time_limit_s: float | None,
    values=None,
) -> bool:
    """Whether ``prob`` has a plan, cheapest proofs first: ``values`` (a relaxation's) rounded,
    by largest value then by leanest strategy; each hint; HiGHS's first solution on the rows."""
    leanest = (None, tables.node_mem)  # each rounding made only if the one before does not fit
    roundings = () if values is None else (_rounded(x, values, mem) for mem in leanest)
    return (
        any(prob.feasible_with(fixed, time_limit_s) for fixed in roundings)
        or any(
            fixed is not None and prob.feasible_with(fixed, time_limit_s)
            for fixed in (_hinted(x, tables, hint) for hint in hints)
        )
        or prob.first_solution(time_limit_s).has_solution
    )


def _hinted(x: dict[str, list], tables: CostTables, hint: Mapping[str, Strategy]) -> dict[int, float] | None:
    """``hint``'s strategy of each node at 1, the others at 0 (as ``_rounded``), or None where some
    node of ``tables`` has no strategy in ``hint`` that it offers."""
    fixed = {}
    for v, xs in x.items():
        if isinstance(xs[0], int):
            continue
        try:
            k = tables.strategies[v].index(hint.get(v))
        except ValueError:  # no hint for v, or one its tables do not offer
            return None
        for i, var in enumerate(xs):
            fixed[var.index] = 1.0 if i == k else 0.0
    return fixed


def solver_name(name: str | None = None) -> str:
    """HiGHS (through highspy, the model passed whole) when it is installed, else CBC (PuLP's
    bundled binary, which always works); ``AUTOPAR_SOLVER`` picks one."""
    name = name or os.environ.get("AUTOPAR_SOLVER") or ("HiGHS" if highs_available() else "CBC")
    if name not in ("HiGHS", "CBC"):
        raise SolverError(f"unknown solver {name!r}: use 'HiGHS' or 'CBC'")
    return name


def _node_vars(prob: Model, tables: CostTables, integer: bool = True) -> dict[str, list]:
    x = {}
    for i, (v, ss) in enumerate(tables.strategies.items()):
        if len(ss) == 1:
            x[v] = [1]  # constant: no variable needed
            continue
        x[v] = prob.vars([f"x_{i}_{s}" for s in range(len(ss))], 0, 1, integer)
        prob.eq_distinct(x[v], [1.0] * len(ss), 1)
    return x


def _fold_edge(e: Edge, tables: CostTables, lin_cost: dict, shared: Folds) -> bool:
    n_src, n_dst = len(tables.strategies[e.src]), _n_dst(e, tables)
    if e.src == e.dst:  # inside one class of repeated nodes: both ends take the same strategy
        pairs = [(e.src, a, a, a) for a in range(n_src)]
    elif n_src == 1 and e.dst == "output":  # a constant: no cost term (``evaluate`` reports it), but memory
        shared.absorb_edge(tables, e, 0, 0, e.src, 0, 1)
        return True
    elif n_src == 1:
        pairs = [(e.dst, b, 0, b) for b in range(n_dst)]
    elif n_dst == 1:
        pairs = [(e.src, a, a, 0) for a in range(n_src)]
    else:
        return False
    n = len(tables.strategies[pairs[0][0]])
    for v, s, a, b in pairs:
        lin_cost[v][s] += e.cost[a][b]
        shared.absorb_edge(tables, e, a, b, v, s, n)
    return True


def _forbid(prob: Model, x: dict, lin_cost: dict) -> None:
    """Strategies whose folded cost is infinite (a forbidden pair) are fixed to 0."""
    for v, cs in lin_cost.items():
        for s, c in enumerate(cs):
            if math.isinf(c):
                if isinstance(x[v][s], int):
                    raise SolverError(f"node {v}: its only strategy is forbidden by the axis roles")
                prob.eq([(x[v][s], 1)], 0)
                cs[s] = 0.0


def _n_dst(e: Edge, tables: CostTables) -> int:
    return 1 if e.dst == "output" else len(tables.strategies[e.dst])


def _sharing_groups(edges: list[Edge]) -> dict[int, tuple[str, int]]:
    """id(edge) -> its group, for edges that carry one tensor to two or more consumers (each of
    the graph's instances of them, ``count``): their pairs that run the same reshard share it
    (``Edge.share_key``), and the ILP pays it once (``z``)."""
    groups: dict[tuple[str, int], list[Edge]] = {}
    for e in edges:
        if e.tensor and e.dst != "output":
            groups.setdefault((e.tensor, e.count), []).append(e)
    return {id(e): g for g, es in groups.items() if len(es) > 1 for e in es}


def _share_keys(e: Edge, ids: dict):
    """``e.share_key`` as a function of (a, b) over small numbers: each placement of the edge
    numbered once in ``ids`` (equal placements, one number), so a key hashes ints, not placements
    (the pairs' keys were a tenth of a large mesh's ILP build)."""
    if not e.tensor or e.have is None or e.need is None:
        return lambda a, b: None
    have = [ids.setdefault(h, len(ids)) for h in e.have]
    need = [(ids.setdefault(n, len(ids)), f) for n, f in e.need]
    out = e.dst == "output"

    def key(a: int, b: int) -> tuple | None:
        h, (n, f) = have[a], need[a if out else b]
        return None if h == n and not f else (h, n, f)

    return key


def _edge_vars(prob: Model, e: Edge, x: dict, tables: CostTables, by_key: bool = False) -> dict:
    """y over groups of identical rows and of identical columns of the edge's (cost, memory) tables:
    strategies that differ elsewhere often reshard this tensor alike (same output placement, same
    requirement), so one y serves them all. Keyed by the groups' first (a, b). ``by_key``: rows
    and columns also differ by the placements they reshard between (for ``Edge.share_key``)."""
    idx = prob.num_constraints
    n_src, n_dst = len(tables.strategies[e.src]), _n_dst(e, tables)
    tabs = [t for t in (e.cost, e.mem, e.peak, e.keep) if t is not None]
    rows: dict[tuple, list[int]] = {}
    for a in range(n_src):
        rows.setdefault(tuple(tuple(t[a]) for t in tabs) + ((e.have[a],) if by_key else ()), []).append(a)
    cols: dict[tuple, list[int]] = {}
    columns = [list(zip(*t)) if n_src else [()] * n_dst for t in tabs]  # each table transposed
    for b in range(n_dst):
        sig = tuple(c[b] for c in columns)
        cols.setdefault(sig + ((e.need[b],) if by_key else ()), []).append(b)
    row_groups, col_groups = list(rows.values()), list(cols.values())
    keys = [(g[0], h[0]) for g in row_groups for h in col_groups]
    made = prob.vars([f"y_{idx}_{a}_{b}" for a, b in keys], 0, 1)
    ys = dict(zip(keys, made))
    # the linking rows (module docstring, (2)): y, then x, each column once (the groups partition
    # the strategies), so built without summing terms
    nc = len(col_groups)
    xs, xd = x[e.src], x[e.dst]
    for i, g in enumerate(row_groups):
        prob.eq_distinct(made[i * nc : (i + 1) * nc] + [xs[a] for a in g], [1.0] * nc + [-1.0] * len(g), 0)
    nr = len(row_groups)
    for j, h in enumerate(col_groups):
        prob.eq_distinct(made[j::nc] + [xd[b] for b in h], [1.0] * nr + [-1.0] * len(h), 0)
    return ys


def evaluate(tables: CostTables, choice: dict[str, int]) -> tuple[float, float]:
    """(seconds, bytes) of a full assignment: the ILP objective and memory, computed directly."""
    return objective_s(tables, choice), peak_bytes(tables, choice)


def objective_s(tables: CostTables, choice: dict[str, int]) -> float:
    """The ILP objective of a full assignment [s], computed directly (``evaluate`` without the
    memory, for callers that price memory their own way or not at all)."""
    t = sum(tables.node_cost[v][s] for v, s in choice.items())
    for e in tables.edges:
        t += e.cost[choice[e.src]][0 if e.dst == "output" else choice[e.dst]]
    return t + sum(tables.bucket_fixed[a] for a in bucket_axes(tables, choice))


def bucket_axes(tables: CostTables, choice: dict[str, int]) -> set[int]:
    """Mesh axes on which a full assignment defers some parameter's "f" to a gradient bucket."""
    return {
        a for e in tables.edges if e.bucketed is not None for a in e.bucketed[choice[e.src]][choice[e.dst]]
    }


# a bucket constraint: g[axis] >= sum of coef * x[node][strategy] + const
BucketRow = tuple[int, dict[tuple[str, int], float], float]


def _bucket_rows(tables: CostTables, target: CostTables, merged: list | None = None) -> list[BucketRow]:
    """The constraints that make the ILP on ``target`` (``tables`` itself, or its folded form,
    whose followers ``merged`` took responses) pay ``tables.bucket_fixed[a]`` when any pair of
    ``tables``' edges that defers a parameter's "f" on axis ``a`` is chosen:

        g[a] >= X[u, s_u] + sum_{s_v in B} X[v, s_v] - 1     (B: the s_v deferring on a with s_u)

    an exact linearization of "u takes s_u and v one of B" (the sum over one node's strategies is
    at most 1), with ``X[u, s]`` the sum of the ``target`` variables of u's root (u itself, or the
    producer it was folded into, transitively) whose responses give u the strategy s. A source
    with one strategy drops its term and the -1."""
    follows = {v: (u, resp) for v, (u, resp) in merged or []}
    roots: dict[str, tuple[str, list[int]]] = {}

    def root(v: str) -> tuple[str, list[int]]:
        if v not in roots:
            if v in target.strategies:
                roots[v] = (v, list(range(len(target.strategies[v]))))
            else:
                u, resp = follows[v]
                r, pick = root(u)
                roots[v] = (r, [resp[i] for i in pick])
        return roots[v]

    rows: list[BucketRow] = []
    for e in tables.edges:
        if e.bucketed is None or e.dst == "output":
            continue
        single = len(tables.strategies[e.src]) == 1
        for su, row in enumerate(e.bucketed):
            for axis in sorted({a for axes in row for a in axes}):
                coef: dict[tuple[str, int], float] = {}
                const = 0.0
                terms = [(e.dst, {sv for sv, axes in enumerate(row) if axis in axes})]
                if not single:
                    terms.append((e.src, {su}))
                    const = -1.0
                for v, picked in terms:
                    r, pick = root(v)
                    for i, s in enumerate(pick):
                        if s in picked:
                            coef[(r, i)] = coef.get((r, i), 0.0) + 1.0
                rows.append((axis, coef, const))
    unique = {(axis, tuple(sorted(coef.items())), const): (axis, coef, const) for axis, coef, const in rows}
    return list(unique.values())
