r"""The ILP's memory constraint (3): the peak per device, from liveness over the step.

Positions are the nodes' places in the traced graph (forward order; backward runs them in reverse).
Every byte the plan keeps until backward (``CostTables.node_mem``, ``Edge.mem``) is charged from
the position where it is made on: a node's at the node, an edge's at its source (a copy made at the
consumer is charged a little early: never less). Backward frees it when the last node that needs
it has run, i.e. after the earliest of them; counting it at every later position, backward as
forward, can only over-count. So when the node at position ``p`` runs, forward or backward, at
most ``S(p)`` bytes are kept, the sum of what is charged at positions <= p, and the step's peak is

    peak = max( S(end),  max_p  S(p) + z_p ),       z_p = the largest transient at p

where a transient is what one node's backward (``node_peak``, at the node), or one reshard's
collectives (``Edge.peak``, ``cost_model.memory``; half a position before the consumer: they run
before its forward and after its backward), hold while they run. ``S`` is linear in x and y; in the ILP
it is a chain of sums (one variable per position that can matter), so the row costs one term per
variable and segment, not per variable and position:

    S_1 = sum_{terms at positions <= p_1} ...,   S_j = S_{j-1} + sum_{terms in (p_{j-1}, p_j]} ...
    S_j + z_j <= M  for every j,   S_end <= M,   z_j >= sum_s p[v,s] x[v,s] for each transient at p_j

Gradients (``CostTables.grad_mem``) are not kept from forward: backward allocates a parameter's
gradient when it reaches the parameter's last use, and it lives to the end of the step. So it is
live at the positions up to that use: it is charged at ``START`` (before every position) and
released just after the last use (``grad_free``), a negative charge there; ``S(p)`` then counts,
at each position, the kept bytes plus the gradients backward has made by the time it gets there.

The optimizer's step runs after backward, when every parameter, optimizer state, gradient and
output the caller holds is live and no activation is: ``S`` at the last placeholder's position
counts all of these (and the copies of parameters kept for backward, over). Its temporaries
(Adam's ``sqrt`` and the division of it, ``CostTables.step_peak``) are a transient there, which
``peak_bytes`` adds and the search checks the chosen plan against (the rows leave it out).

A position is left out when a later one's smallest transient is at least its largest, less what
gradients can release between them. A storage several consumers keep as it is (``Kept.shared``
in ``costs``) is charged once, at its owner's positions (``CostTables.keep_positions``: the
members of its class that several consumers keep): ``K_o`` >= each of its keepers' terms
(``Edge.keep``).

Repeated blocks share variables (``coarsen``): a class's terms are spread over its members'
positions, and its transient, the same for every member, matters at the last member's only.
Folding an edge or a follower into a node (``solver.fold_followers``, ``solver._fold_edge``)
makes its terms the node's, each still charged at its own positions (``Folds``).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from autopar.passes.costs import CostTables, Edge
from autopar.passes.lp_model import Model

END = math.inf  # after the last node: what the caller holds after forward, the start of backward
START = -1.0  # before the first node: where gradients are charged (released after their last use)


@dataclass
class Folds:
    """Each node's memory terms with where they are charged, as folding edges and followers into
    nodes (``solver``) gathers them: bytes keep their own positions (sums), transients theirs
    (maxima per position), shared storages their owner (maxima per owner)."""

    mem: dict[str, dict[tuple[float, ...], list[float]]]  # node -> positions -> per strategy
    peak: dict[str, dict[float, list[float]]]  # node -> position -> per strategy: the largest there
    keep: dict[str, dict[str, list[float]]]  # node -> owner -> per strategy

    @classmethod
    def of(cls, tables: CostTables) -> Folds:
        if tables.mem_at:  # folded tables: their node_mem only sums these up
            mem = {v: {ps: list(t) for ps, t in d.items()} for v, d in tables.mem_at.items()}
        else:
            mem = {v: {positions(tables, v): list(t)} for v, t in tables.node_mem.items()}
        peak = {v: {p: list(t) for p, t in d.items()} for v, d in tables.peak_at.items()}
        for v, t in tables.node_peak.items():
            _raise(peak.setdefault(v, {}).setdefault(last(tables, v), [0.0] * len(t)), t)
        return cls(mem, peak, {v: {o: list(t) for o, t in d.items()} for v, d in tables.node_keep.items()})

    def absorb_edge(self, tables: CostTables, e: Edge, a: int, b: int, node: str, s: int, n: int) -> None:
        """Edge ``e``'s pair (a, b) becomes part of ``node``'s strategy ``s`` (of ``n``)."""
        if m := e.mem[a][b]:
            self.mem.setdefault(node, {}).setdefault(edge_charge_positions(tables, e), [0.0] * n)[s] += m
        if e.peak is not None and e.peak[a][b]:
            row = self.peak.setdefault(node, {}).setdefault(edge_position(tables, e), [0.0] * n)
            row[s] = max(row[s], e.peak[a][b])
        if e.keep is not None and e.keep[a][b]:
            row = self.keep.setdefault(node, {}).setdefault(e.owner, [0.0] * n)
            row[s] = max(row[s], e.keep[a][b])

    def absorb_node(self, v: str, b: int, node: str, s: int, n: int) -> None:
        """Node ``v``'s strategy b becomes part of ``node``'s strategy ``s`` (of ``n``)."""
        for ps, t in self.mem.get(v, {}).items():
            self.mem.setdefault(node, {}).setdefault(ps, [0.0] * n)[s] += t[b]
        for p, t in self.peak.get(v, {}).items():
            row = self.peak.setdefault(node, {}).setdefault(p, [0.0] * n)
            row[s] = max(row[s], t[b])
        for o, t in self.keep.get(v, {}).items():
            row = self.keep.setdefault(node, {}).setdefault(o, [0.0] * n)
            row[s] = max(row[s], t[b])

    def drop(self, v: str) -> None:
        self.mem.pop(v, None)
        self.peak.pop(v, None)
        self.keep.pop(v, None)


def _raise(row: list[float], t: list[float]) -> None:
    for s, value in enumerate(t):
        row[s] = max(row[s], value)


def positions(tables: CostTables, v: str) -> tuple[float, ...]:
    """The positions of node ``v``'s class members (graph order); without any recorded, its place
    among the tables' nodes."""
    if v not in tables.positions:
        tables.positions.update(
            {u: (i,) for i, u in enumerate(tables.strategies) if u not in tables.positions}
        )
    return tables.positions[v]


def last(tables: CostTables, v: str) -> float:
    return positions(tables, v)[-1]


def edge_charge_positions(tables: CostTables, e: Edge) -> tuple[float, ...]:
    """Where an edge's kept bytes are charged: at its source's positions, and for an edge to the
    graph output at ``START``: the caller holds the output through the whole backward, so backward
    still has it at positions before the one that made it."""
    return (START,) if e.dst == "output" else positions(tables, e.src)


def edge_position(tables: CostTables, e: Edge) -> float:
    """Where an edge's collectives run: just before its consumer (its last member) in forward, just
    after it in backward; either way its consumer's own bytes are not there yet, or no longer
    (half a position early). The graph output's run at the end."""
    return END if e.dst == "output" else last(tables, e.dst) - 0.5


def owner_positions(tables: CostTables, owner: str) -> tuple[float, ...]:
    """Where a shared storage is charged: its class members that several consumers keep."""
    return tables.keep_positions.get(owner) or positions(tables, owner)


# -- evaluation of a full assignment ----------------------------------------------------------------


def peak_bytes(
    tables: CostTables,
    choice: dict[str, int],
    extra: dict[float, float] | None = None,
    deferred: frozenset[str] | set[str] = frozenset(),
) -> float:
    """The peak per device of a full assignment, as the ILP's rows count it, except that edges of
    one tensor that take the same reshard keep one copy: the ILP's rows count each edge's, an upper
    bound (which keeps every plan it accepts within the limit), and that the optimizer step's
    temporaries count (``CostTables.step_peak``; the rows leave them out). ``extra``: more
    transients, by position (the gradient buckets' flattening, ``passes/grad_sync.py:bucket_transients``).
    ``deferred``: parameters whose gradient is all-reduced in a bucket (``deferred_grad_axes``):
    their uses run no "f", so none clones a gradient (the rows count the clone: an upper bound)."""
    charged: list[tuple[tuple[float, ...], float]] = []  # (positions, bytes per position)
    transients: dict[float, float] = dict(extra or {})
    shared = Folds.of(tables)
    keep: dict[str, float] = {}
    step = max((tables.step_peak[v][s] for v, s in choice.items() if v in tables.step_peak), default=0.0)
    if step:  # the optimizer's step, after backward (``CostTables.step_peak``)
        transients[tables.step_position] = max(transients.get(tables.step_position, 0.0), step)
    for v, s in choice.items():
        charged += [(ps, t[s] / len(ps)) for ps, t in shared.mem.get(v, {}).items()]
        for p, t in shared.peak.get(v, {}).items():
            transients[p] = max(transients.get(p, 0.0), t[s])
        for o, t in shared.keep.get(v, {}).items():
            keep[o] = max(keep.get(o, 0.0), t[s])
    # (tensor, instances, reshard) -> each of its edges' copy and where it is charged
    copies: dict[tuple, list[tuple[tuple[float, ...], float]]] = {}
    for e in tables.edges:
        a, b = choice[e.src], (0 if e.dst == "output" else choice[e.dst])
        ps = edge_charge_positions(tables, e)
        charged.append((ps, e.mem[a][b] / len(ps)))
        key = e.share_key(a, b)
        if e.copy is not None and e.copy[a][b] and key is not None:
            copies.setdefault((e.tensor, e.count, key), []).append((ps, e.copy[a][b]))
        if e.peak is not None and e.src not in deferred:
            p = edge_position(tables, e)
            transients[p] = max(transients.get(p, 0.0), e.peak[a][b])
        if e.keep is not None:
            keep[e.owner] = max(keep.get(e.owner, 0.0), e.keep[a][b])
    charged += [(owner_positions(tables, o), k) for o, k in keep.items()]
    # uses that take one reshard keep one copy (codegen makes it once, passes/grad_sync.py:reshard_key):
    # the one the graph output holds when it is among them (the longest lived), else the largest
    for kept in copies.values():
        keep_one = max(kept, key=lambda pc: (pc[0] == (START,), pc[1]))
        kept.remove(keep_one)
        charged += [(ps, -c / len(ps)) for ps, c in kept]
    charged += _grad_charges(tables, choice)
    at: dict[float, float] = {}
    for ps, m in charged:
        for p in ps:
            at[p] = at.get(p, 0.0) + m
    total, peak = 0.0, 0.0
    for p in sorted(set(at) | set(transients) | {END}):
        total += at.get(p, 0.0)
        peak = max(peak, total + transients.get(p, 0.0))
    return peak


def _grad_charges(tables: CostTables, choice: dict[str, int]) -> list[tuple[tuple[float, ...], float]]:
    """Each chosen gradient: its bytes at START, minus each member's share after its last use."""
    out = []
    for v, g in tables.grad_mem.items():
        if v in choice and g[choice[v]]:
            free = tables.grad_free[v]
            out.append(((START,), g[choice[v]]))
            out.append((free, -g[choice[v]] / len(free)))
    return out


def _edge_least(tables: CostTables) -> tuple[dict[float, float], dict[float, float]]:
    """The edges' part of ``lower_bound_bytes``: each edge's smallest kept bytes summed per
    position, and the largest of their smallest transients per position. Tables traded alike share
    one list of edges (``trades._traded_edges``): computed once per list (the last few kept)."""
    key = id(tables.edges)
    hit = _EDGE_LEAST.get(key)
    if hit is not None and hit[0] is tables.edges and hit[1] == id(tables.positions):
        return hit[2]
    at: dict[float, float] = {}
    least: dict[float, float] = {}
    for e in tables.edges:
        ps = edge_charge_positions(tables, e)
        m = min(min(row) for row in e.mem)
        for p in ps:
            at[p] = at.get(p, 0.0) + m / len(ps)
        if e.peak is not None:
            p = edge_position(tables, e)
            least[p] = max(least.get(p, 0.0), min(min(row) for row in e.peak))
    if len(_EDGE_LEAST) >= 16:
        del _EDGE_LEAST[next(iter(_EDGE_LEAST))]
    _EDGE_LEAST[key] = (tables.edges, id(tables.positions), (at, least))
    return at, least


# id(edges) -> (the edges, id of the positions they were placed by, their part of the bound)
_EDGE_LEAST: dict[int, tuple[list, int, tuple[dict[float, float], dict[float, float]]]] = {}


def lower_bound_bytes(tables: CostTables, edge_trade: EdgeTrade | None = None) -> float:
    """A lower bound on the peak of every plan on these tables: each node's and each edge's bytes
    at their smallest, and at each position the largest of the smallest transients there.

    The climb asks it of every rung (``passes/ladder.py``; a DeepSeek-V3 search 2,100 times, on
    tables of 8,500 positions): where each term is charged depends only on the tables' layout,
    which the rungs of one candidate share, so the positions are sorted and indexed once per
    layout (``_BoundLayout``) and each call sums the terms with numpy, in the order the loop of
    ``lower_bound_bytes_loop`` adds them (``np.add.at`` adds repeated indices in order; a
    cumulative sum adds left to right): the same float, bit for bit (``tests/test_memory_bound.py``).

    ``edge_trade``: the edges are ``tables.edges`` as ``passes/trades.py:_traded_edges`` would
    trade them (some kept bytes zero, some kept bytes and transients over ``k`` micro-batches),
    priced from their smallest terms without building them: the smallest of ``x / k`` over a row
    is the smallest ``x`` over ``k`` (division by ``k > 0`` rounds monotonically), so the bound is
    the one the traded edges give, bit for bit."""
    lay = _bound_layout(tables)
    node_min = np.fromiter((min(m) for m in tables.node_mem.values()), float, len(tables.node_mem))
    grad_min = np.fromiter((min(g) for g in tables.grad_mem.values()), float, len(tables.grad_mem))
    terms = _edge_terms(tables)
    where = lay.place(terms)
    mem, peak = terms.mem_min, terms.peak_min
    if edge_trade is not None:
        mem = np.where(edge_trade.zero, 0.0, mem)
        if edge_trade.k > 1:
            mem = np.where(edge_trade.divide, mem / edge_trade.k, mem)
            peak = np.where(edge_trade.divide[terms.has_peak], peak / edge_trade.k, peak)
        if edge_trade.kept is not None:  # (1 - f) * x, as the mixed row's entries: its least too
            mem = mem * edge_trade.kept
    edge_at = np.zeros(len(where.positions))
    np.add.at(edge_at, where.edge_at, mem[terms.charge_of] / terms.charge_len)
    at = np.zeros(len(where.positions))
    np.add.at(at, where.node_at, node_min[lay.node_of] / lay.node_len)
    at += edge_at
    grads = np.where(lay.grad_start, grad_min[lay.grad_of], -grad_min[lay.grad_of]) / lay.grad_len
    np.add.at(at, where.grad_at, grads)
    least = np.zeros(len(where.positions))
    if len(tables.node_peak):
        peak_min = np.fromiter((min(t) for t in tables.node_peak.values()), float, len(tables.node_peak))
        np.maximum.at(least, where.node_least, peak_min)
    np.maximum.at(least, where.edge_least, peak)
    return max(0.0, float(np.max(np.cumsum(at) + least)))


@dataclass(frozen=True)
class EdgeTrade:
    """How a rung's trades change the tables' edges (``passes/trades.py:_traded_edges``): per edge,
    whether its kept bytes become zero (``zero``), and whether its kept bytes and transients are
    divided by the ``k`` micro-batches (``divide``)."""

    zero: np.ndarray
    divide: np.ndarray
    k: int
    # per edge, the share of its kept bytes left after the division (None: all of them): a partly
    # recomputed step's edges into a class of which ``f`` of the members recompute keep ``1 - f``
    # (``passes/trades.py:traded_lower_bound``)
    kept: np.ndarray | None = None


def lower_bound_bytes_loop(tables: CostTables) -> float:
    """``lower_bound_bytes`` as a loop over the terms: what it computes, spelled out (and the
    reference its tests hold it to)."""
    at: dict[float, float] = {}

    def charge(ps: tuple[float, ...], m: float) -> None:
        for p in ps:
            at[p] = at.get(p, 0.0) + m / len(ps)

    least: dict[float, float] = {}
    for v, m in tables.node_mem.items():
        charge(positions(tables, v), min(m))
    for v, t in tables.node_peak.items():
        least[last(tables, v)] = max(least.get(last(tables, v), 0.0), min(t))
    edge_at, edge_least = _edge_least(tables)
    for p, m in edge_at.items():
        at[p] = at.get(p, 0.0) + m
    for p, m in edge_least.items():
        least[p] = max(least.get(p, 0.0), m)
    for v, g in tables.grad_mem.items():  # each gradient at its smallest, live up to its last use
        charge((START,), min(g))
        free = tables.grad_free[v]
        charge(free, -min(g))  # spread over the members' last uses
    total, bound = 0.0, 0.0
    for p in sorted(set(at) | set(least) | {END}):
        total += at.get(p, 0.0)
        bound = max(bound, total + least.get(p, 0.0))
    return bound


@dataclass
class _EdgeTerms:
    """One list of edges' terms for ``lower_bound_bytes``: each edge's smallest kept bytes, the
    positions they are charged at (each a 1/len share), and, for the edges with transients, the
    smallest transient and its position. Kept per list (the last few)."""

    edges: list
    positions_key: int  # id of the positions map they were placed by
    mem_min: np.ndarray
    charge_pos: tuple[float, ...]
    charge_of: np.ndarray
    charge_len: np.ndarray
    has_peak: np.ndarray
    peak_min: np.ndarray
    peak_pos: tuple[float, ...]


def _edge_terms(tables: CostTables) -> _EdgeTerms:
    key = id(tables.edges)
    hit = _EDGE_TERMS.get(key)
    if hit is not None and hit.edges is tables.edges and hit.positions_key == id(tables.positions):
        return hit
    mem_min, charge_pos, charge_of, charge_len, has_peak, peak_min, peak_pos = [], [], [], [], [], [], []
    for i, e in enumerate(tables.edges):
        ps = edge_charge_positions(tables, e)
        mem_min.append(min(min(row) for row in e.mem))
        charge_pos.extend(ps)
        charge_of.extend([i] * len(ps))
        charge_len.extend([len(ps)] * len(ps))
        has_peak.append(e.peak is not None)
        if e.peak is not None:
            peak_min.append(min(min(row) for row in e.peak))
            peak_pos.append(edge_position(tables, e))
    got = _EdgeTerms(
        tables.edges, id(tables.positions), np.array(mem_min, float), tuple(charge_pos),
        np.array(charge_of, np.intp), np.array(charge_len, float), np.array(has_peak, bool),
        np.array(peak_min, float), tuple(peak_pos),
    )  # fmt: skip
    if len(_EDGE_TERMS) >= 16:
        del _EDGE_TERMS[next(iter(_EDGE_TERMS))]
    _EDGE_TERMS[key] = got
    return got


# id(edges) -> their terms
_EDGE_TERMS: dict[int, _EdgeTerms] = {}


@dataclass
class _Placed:
    """A layout's and an edge list's positions, sorted (``END`` among them), and the index of
    every term among them, in the order the loop adds them."""

    positions: np.ndarray
    node_at: np.ndarray
    edge_at: np.ndarray
    grad_at: np.ndarray
    node_least: np.ndarray
    edge_least: np.ndarray


@dataclass
class _BoundLayout:
    """Where ``lower_bound_bytes`` charges each node and gradient of tables of one layout (their
    positions, the order of their nodes, gradients and transients): every charge as (the node it
    reads, the share it takes), in the loop's order."""

    key: tuple
    node_pos: list[float]  # a node's charges: at its members' positions, each 1/len of its bytes
    node_of: np.ndarray
    node_len: np.ndarray
    grad_pos: list[float]  # a gradient's: at START whole, then at its frees, -1/len each
    grad_of: np.ndarray
    grad_start: np.ndarray
    grad_len: np.ndarray
    peak_pos: list[float]
    placed: dict

    def place(self, terms: _EdgeTerms) -> _Placed:
        """Every term's index among the positions: per the edges' positions (traded edges keep
        their base's), the last few."""
        key = (terms.charge_pos, terms.peak_pos)
        hit = self.placed.get(key)
        if hit is not None:
            return hit
        order = sorted(
            set(self.node_pos) | set(self.grad_pos) | set(self.peak_pos) | set(terms.charge_pos)
            | set(terms.peak_pos) | {END}
        )  # fmt: skip
        index = {p: i for i, p in enumerate(order)}

        def at(ps) -> np.ndarray:
            return np.fromiter((index[p] for p in ps), np.intp, len(ps))

        got = _Placed(
            np.array(order), at(self.node_pos), at(terms.charge_pos), at(self.grad_pos), at(self.peak_pos),
            at(terms.peak_pos),
        )  # fmt: skip
        if len(self.placed) >= 4:
            del self.placed[next(iter(self.placed))]
        self.placed[key] = got
        return got


def _bound_layout(tables: CostTables) -> _BoundLayout:
    """The layout of ``tables`` for ``lower_bound_bytes``: kept per positions map (the last few),
    checked against the tables' nodes, gradients and transients."""
    key = (tuple(tables.node_mem), tuple(tables.grad_mem), tuple(tables.node_peak))
    hit = _LAYOUTS.get(id(tables.positions))
    if hit is not None and hit[0] is tables.positions and hit[1] is tables.grad_free and hit[2].key == key:
        return hit[2]
    node_pos, node_of, node_len = [], [], []
    for i, v in enumerate(tables.node_mem):
        ps = positions(tables, v)
        node_pos.extend(ps)
        node_of.extend([i] * len(ps))
        node_len.extend([len(ps)] * len(ps))
    grad_pos, grad_of, grad_start, grad_len = [], [], [], []
    for i, v in enumerate(tables.grad_mem):
        free = tables.grad_free[v]
        grad_pos.append(START)
        grad_pos.extend(free)
        grad_of.extend([i] * (1 + len(free)))
        grad_start.extend([True] + [False] * len(free))
        grad_len.extend([1] + [len(free)] * len(free))
    lay = _BoundLayout(
        key, node_pos, np.array(node_of, np.intp), np.array(node_len, float), grad_pos,
        np.array(grad_of, np.intp), np.array(grad_start, bool), np.array(grad_len, float),
        [last(tables, v) for v in tables.node_peak], {},
    )  # fmt: skip
    if len(_LAYOUTS) >= 16:
        del _LAYOUTS[next(iter(_LAYOUTS))]
    _LAYOUTS[id(tables.positions)] = (tables.positions, tables.grad_free, lay)
    return lay


# id(positions map) -> (the map, the gradients' frees, its layout)
_LAYOUTS: dict[int, tuple[dict, dict, _BoundLayout]] = {}


# -- the ILP's rows ---------------------------------------------------------------------------------


def add_memory_rows(prob: Model, x: dict, quad: list, limit: float, shared: Folds, tables: CostTables):
    """Constraint family (3), see the module docstring. ``x``: node variables (1 for a node with one
    strategy); ``quad``: (edge, {(a, b): y}) for the edges left in the ILP; ``shared``: each node's
    terms, with the other edges folded in."""
    if not math.isfinite(limit):
        return
    # in units of the limit: byte-sized coefficients (1e10) trip HiGHS's presolve into "infeasible"
    g = 1 / limit if limit > 0 else 1.0
    # transient rows by position, and the rows bounding each shared storage
    # (each a row: its variables and their bytes, as two lists)
    rows: dict[float, list[tuple[list, list[float]]]] = {}
    keeps: dict[str, list[tuple[list, list[float]]]] = {}
    for v, d in shared.peak.items():
        for p, t in d.items():
            rows.setdefault(p, []).append((x[v], list(t)))
    for v, d in shared.keep.items():
        for o, t in d.items():
            keeps.setdefault(o, []).append((x[v], list(t)))
    for e, ys in quad:
        if e.peak is not None and any(e.peak[a][b] for a, b in ys):
            rows.setdefault(edge_position(tables, e), []).append(
                (list(ys.values()), [e.peak[a][b] for a, b in ys])
            )
        if e.keep is not None and any(e.keep[a][b] for a, b in ys):
            keeps.setdefault(e.owner, []).append((list(ys.values()), [e.keep[a][b] for a, b in ys]))
    # gradients: charged at START, released after each member's last use (most a position can free)
    grads = [(v, gm) for v, gm in tables.grad_mem.items() if v in x and any(gm)]
    releases: dict[float, float] = {}
    for v, gm in grads:
        free = tables.grad_free[v]
        for p in free:
            releases[p] = releases.get(p, 0.0) + max(gm) / len(free)
    cuts = _positions_that_matter(rows, releases)
    # what each segment (p_{j-1}, p_j] is charged: (variable, bytes) pairs
    segments: list[list[tuple]] = [[] for _ in range(len(cuts) + 1)]

    hits: dict[tuple[float, ...], list[tuple[list, int]]] = {}  # positions -> (segment, how many)

    def where(ps: tuple[float, ...]) -> list[tuple[list, int]]:
        # a class's members share their positions across its strategies and edges: the segments
        # they fall in are found once per positions tuple (80-layer models: 80 positions each)
        got = hits.get(ps)
        if got is None:
            count: dict[int, int] = {}
            for p in ps:
                j = bisect.bisect_left(cuts, p)
                count[j] = count.get(j, 0) + 1
            got = hits[ps] = [(segments[j], n) for j, n in count.items()]
        return got

    def charge(ps: tuple[float, ...], var, amount: float) -> None:
        for seg, n in where(ps):
            seg.append((var, amount * g * n))

    # the two loops below are charge's, inlined: a term per strategy and per edge pair (the most
    # calls of a large mesh's ILP build)
    for v, d in shared.mem.items():
        xv = x[v]
        for ps, ms in d.items():
            at, k = where(ps), len(ps)
            for s, m in enumerate(ms):
                if m:
                    amount = m / k
                    for seg, n in at:
                        seg.append((xv[s], amount * g * n))
    for e, ys in quad:
        ps = edge_charge_positions(tables, e)
        at, k, mem = where(ps), len(ps), e.mem
        for (a, b), y in ys.items():
            if mem[a][b]:
                amount = mem[a][b] / k
                for seg, n in at:
                    seg.append((y, amount * g * n))
    for v, gm in grads:
        free = tables.grad_free[v]
        for s, b in enumerate(gm):
            if b:
                charge((START,), x[v][s], b)
                charge(free, x[v][s], -b / len(free))
    for i, (o, rs) in enumerate(keeps.items()):
        k = _bound(prob, f"keep_{i}", rs, g)
        if k is not None:
            charge(owner_positions(tables, o), k, 1.0 / g)
    total = None
    for j, seg in enumerate(segments):
        s = prob.var(f"kept_{j}", 0)
        terms = seg + ([(total, 1)] if total is not None else []) + [(s, -1)]
        prob.eq(terms, 0)
        total = s
        if j < len(cuts):
            z = _bound(prob, f"peak_{j}", rows[cuts[j]], g)
            prob.le([(s, 1), (z, 1)], 1.0)
    prob.le([(total, 1)], 1.0)


def _positions_that_matter(
    rows: dict[float, list[tuple[list, list[float]]]], releases: dict[float, float] | None = None
) -> list[float]:
    """Positions with a transient that some plan could make binding: drop p when a later position
    q's smallest transient is at least p's largest plus the most gradients can release in (p, q]
    (S(q) >= S(p) minus those releases: everything else only adds)."""
    releases = releases or {}
    freed = sorted(releases)
    keep, best, prev = [], -math.inf, None
    for p in sorted(rows, reverse=True):
        if prev is not None:  # what (p, prev] can release lowers every later position's claim
            lo_i, hi_i = bisect.bisect_right(freed, p), bisect.bisect_right(freed, prev)
            best -= sum(releases[f] for f in freed[lo_i:hi_i])
        hi = max(max(cs) for _, cs in rows[p])
        lo = max(min(cs) for _, cs in rows[p])
        if hi > best:
            keep.append(p)
        best = max(best, lo)
        prev = p
    return sorted(keep)


def _bound(prob: Model, name: str, rows: list[tuple[list, list[float]]], g: float):
    """A variable >= every row (each variables and their bytes, one variable equal to 1 in any
    plan)."""
    floor = max((min(cs) for _, cs in rows), default=0.0)
    rows = [r for r in rows if max(r[1]) > floor]
    if floor == 0 and not rows:
        return None
    z = prob.var(name, floor * g)
    for vs, cs in rows:
        prob.le([(var, c * g) for var, c in zip(vs, cs) if c] + [(z, -1)], 0)
    return z
