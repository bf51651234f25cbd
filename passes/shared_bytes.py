"""Memory that counts once, not once per term: the maxima in the plan's peak (``solver``, (3)).

The peak per device is a sum (what is kept until backward: ``CostTables.node_mem`` and
``Edge.mem``) plus two kinds of maxima:

* the step's largest transient ``z``: a node's backward (``CostTables.node_peak``) or the
  collectives of a reshard (``Edge.peak``, ``cost_model.memory``), whichever holds most at once;
* for every storage that several consumers keep as it is (``Kept.shared`` in ``costs``), its bytes
  once: ``K_o`` the largest of its terms (``Edge.keep``, one per consumer), times the size of its
  class of repeated nodes.

Folding an edge into a node (``solver.fold_followers``, ``solver._fold_edge``) moves its maxima
into the node's: ``absorb_edge`` and ``absorb_node`` keep, per node and strategy, the largest term
of each kind (a max of maxima is the same max).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.passes.costs import CostTables, Edge


@dataclass
class SharedBytes:
    peak: dict[str, list[float]]  # node -> per strategy: the largest transient folded into it
    keep: dict[str, dict[str, list[float]]]  # node -> owner -> per strategy

    @classmethod
    def of(cls, tables: CostTables) -> SharedBytes:
        return cls(
            {v: list(p) for v, p in tables.node_peak.items()},
            {v: {o: list(t) for o, t in d.items()} for v, d in tables.node_keep.items()},
        )

    def absorb_edge(self, e: Edge, a: int, b: int, node: str, s: int, n: int) -> None:
        """Edge ``e``'s pair (a, b) becomes part of ``node``'s strategy ``s`` (of ``n``)."""
        if e.peak is not None and e.peak[a][b]:
            _raise(self.peak.setdefault(node, [0.0] * n), s, e.peak[a][b])
        if e.keep is not None and e.keep[a][b]:
            _raise(self.keep.setdefault(node, {}).setdefault(e.owner, [0.0] * n), s, e.keep[a][b])

    def absorb_node(self, v: str, b: int, node: str, s: int, n: int) -> None:
        """Node ``v``'s strategy b becomes part of ``node``'s strategy ``s`` (of ``n``)."""
        if v in self.peak:
            _raise(self.peak.setdefault(node, [0.0] * n), s, self.peak[v][b])
        for o, t in self.keep.get(v, {}).items():
            _raise(self.keep.setdefault(node, {}).setdefault(o, [0.0] * n), s, t[b])

    def drop(self, v: str) -> None:
        self.peak.pop(v, None)
        self.keep.pop(v, None)


def _raise(row: list[float], s: int, value: float) -> None:
    row[s] = max(row[s], value)


def shared_bytes(tables: CostTables, choice: dict[str, int]) -> float:
    """The maxima of a full assignment: the largest transient plus each shared storage once."""
    z = max((p[choice[v]] for v, p in tables.node_peak.items() if v in choice), default=0.0)
    keep: dict[str, float] = {}
    for v, d in tables.node_keep.items():
        for o, t in d.items():
            keep[o] = max(keep.get(o, 0.0), t[choice[v]])
    for e in tables.edges:
        b = 0 if e.dst == "output" else choice[e.dst]
        if e.peak is not None:
            z = max(z, e.peak[choice[e.src]][b])
        if e.keep is not None:
            keep[e.owner] = max(keep.get(e.owner, 0.0), e.keep[choice[e.src]][b])
    return z + sum(k * owner_count(tables, o) for o, k in keep.items())


def owner_count(tables: CostTables, owner: str) -> int:
    """How many storages an owner stands for: the size of its class of repeated nodes."""
    return tables.classes.count(owner) if tables.classes is not None else 1
