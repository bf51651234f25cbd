"""Communication costs in seconds: collectives per mesh axis (alpha-beta, ring) and resharding.

Mesh layout: ranks are laid out row-major over the mesh, so the LAST axis is the fastest (its
groups are runs of consecutive ranks, inside a node when it fits). For axis ``a`` with size
``n_a`` and stride ``s_a = prod(mesh[a+1:])`` a group spans ``s_a * n_a`` consecutive ranks:

* inside one node when ``s_a * n_a <= devices_per_node``: the intra-node link;
* otherwise the inter-node link (each device has its own NIC; bandwidth per device).

Ring alpha-beta costs (Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 2005; the same bus-bandwidth convention as nccl-tests), with ``B``
the bytes of the *full* (unsharded-over-the-axis) tensor, ``n`` the group size, ``bw`` the link's
bus bandwidth (B/s) and ``lat`` its latency (s), both those of the collective and the size range
``B`` falls in when the link has ranges (``LinkSpec.at``; a calibrated link fits one pair per
collective and size range):

* all-reduce:              2 (n-1)/n * B / bw + 2 (n-1) lat
* all-gather, reduce-scatter, all-to-all:  (n-1)/n * B / bw + (n-1) lat
* send/recv:               B / bw + lat

An axis whose groups lie inside a node takes the ``(bw, lat)`` its own group size and stride were
measured at, where ``autopar calibrate`` measured them (``group_ranges``: every group of the
axis at once, as the mesh runs them), and the full group's otherwise. The ring's ``(n-1)``
latency terms do not carry from one group size to another where ranks share cores: on the 2-core
development VM, with each of 4 gloo ranks bound to a core, a 1 KiB all-reduce added 1.8 ms to a
loop of steps on all 4, 1.3 ms on pairs of neighbours and on pairs that share a core, a 256 KiB
one 2.5, 2.9 and 1.8 ms (``autopar calibrate --world-size 4``), where the 4-rank fit predicts
0.6 and 1.1 ms for any pair.

Two more algorithms, as NCCL picks between them (NCCL docs, "NCCL_ALGO"; Sanders, Speck,
Traeff, "Two-tree algorithms for full bandwidth broadcast, reduction and scan", 2009):

* tree all-reduce (double binary tree), for groups that cross nodes (inside a node NCCL rings):
  2 ceil(log2 n) lat + 2 B / bw. Latency grows with log n instead of n, so small messages on
  large groups take it.
* hierarchical, for an axis whose group spans k whole nodes with m of its ranks in each
  (consecutive ranks, ``stride * m = devices_per_node``):
  all-reduce(B) = reduce-scatter_intra(m, B) + all-reduce_inter(k, B / m) + all-gather_intra(m, B);
  all-gather(B) = all-gather_inter(k, B / m) + all-gather_intra(m, B);
  reduce-scatter(B) = reduce-scatter_intra(m, B) + reduce-scatter_inter(k, B / m).

``CommModel.time`` prices each collective at the cheapest algorithm that applies.

Resharding one tensor from ``src`` to ``dst`` placements is done axis by axis (see
``codegen/collectives.py`` for the code that runs it). Forward and backward are both priced:
gradients of Replicate/Partial values are full, gradients of Shard values are shards, so

=============  ======================  ====================================================
transition     forward                 backward (only when the value needs a gradient)
=============  ======================  ====================================================
S(d) -> R      all-gather              local slice (free), or reduce-scatter when fused
                                       with a Megatron "f" (see below)
R -> S(d)      local slice (free)      all-gather
P -> R         all-reduce              nothing
P -> S(d)      reduce-scatter          all-gather
R -> P         local mask (free)       nothing
S(d) -> S(e)   all-gather + slice      all-gather + slice
=============  ======================  ====================================================

The "f" operator (identity forward, all-reduce backward; Megatron-LM, Shoeybi et al. 2019) is
inserted on a Replicate input of an op that is split over the axis: each rank then holds a
partial gradient of that input.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

from autopar.cluster import ClusterSpec, LinkSpec
from autopar.placement import Spec, is_partial, is_replicate, is_shard


class Collective(enum.Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"


# ``LinkSpec.ranges`` name of the all-reduce issued behind another one still in flight
QUEUED_ALL_REDUCE = "all_reduce_queued"


def group_ranges(name: str, n: int, stride: int) -> str:
    """The ``LinkSpec.ranges`` name of collective ``name`` (or ``QUEUED_ALL_REDUCE``) on groups of
    ``n`` ranks ``stride`` apart inside a node, every such group at once, as a mesh axis of that
    size and stride runs it: ``"all_reduce/2x1"``. ``autopar calibrate`` measures each group a
    mesh axis of its world can have (``calibrate.group_layouts``), and ``CommModel`` prices an
    axis with its group's figures where the link has them, else with the collective's own."""
    return f"{name}/{n}x{stride}"


def collective_time(
    kind: Collective, nbytes: float, n: int, link: LinkSpec, ranges: str | None = None
) -> float:
    """Seconds for one ring collective over ``n`` ranks; ``nbytes`` is the full tensor's size.
    ``ranges``: the link's ranges to price it with (default: the collective's own)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = link.at(nbytes, ranges or kind.value)
    if kind is Collective.ALL_REDUCE:
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat
    if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return (n - 1) / n * nbytes / bw + (n - 1) * lat
    if kind is Collective.SEND_RECV:
        return nbytes / bw + lat
    raise ValueError(f"unknown collective {kind}")


def tree_all_reduce_time(nbytes: float, n: int, link: LinkSpec) -> float:
    """Seconds for a (double binary) tree all-reduce of ``nbytes`` over ``n`` ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = link.at(nbytes, Collective.ALL_REDUCE.value)
    return 2 * math.ceil(math.log2(n)) * lat + 2 * nbytes / bw


def node_split(cluster: ClusterSpec, mesh_shape: Sequence[int], axis: int) -> tuple[int, int] | None:
    """(m, k) when the axis's groups span k whole nodes with m ranks in each; None otherwise."""
    stride = math.prod(mesh_shape[axis + 1 :])
    n, d = mesh_shape[axis], cluster.devices_per_node
    if stride >= d or stride * n <= d or d % stride or n % (d // stride):
        return None
    m = d // stride
    return m, n // m


def axis_link(cluster: ClusterSpec, mesh_shape: Sequence[int], axis: int) -> LinkSpec:
    stride = math.prod(mesh_shape[axis + 1 :])
    span = stride * mesh_shape[axis]
    return cluster.intra_node if span <= cluster.devices_per_node else cluster.inter_node


class CommModel:
    """Prices collectives and resharding on one mesh of one cluster."""

    def __init__(self, cluster: ClusterSpec, mesh_shape: Sequence[int]):
        self.cluster = cluster
        self.mesh_shape = tuple(mesh_shape)
        self.links = [axis_link(cluster, self.mesh_shape, a) for a in range(len(self.mesh_shape))]
        self.splits = [node_split(cluster, self.mesh_shape, a) for a in range(len(self.mesh_shape))]
        self._cache: dict[tuple, tuple[float, list[str]]] = {}

    def ranges(self, name: str, axis: int) -> str:
        """The ``LinkSpec.ranges`` name that prices collective ``name`` on ``axis``: its group's
        (``group_ranges``) where the axis's groups lie inside a node and the link has figures for
        them, else ``name``'s own."""
        link, n = self.links[axis], self.mesh_shape[axis]
        stride = math.prod(self.mesh_shape[axis + 1 :])
        if stride * n <= self.cluster.devices_per_node:
            key = group_ranges(name, n, stride)
            if any(r[0] == key for r in link.ranges):
                return key
        return name

    def time(self, kind: Collective, nbytes: float, axis: int) -> float:
        """Seconds for one collective on ``axis``: the cheapest of ring, tree and hierarchical."""
        n, link = self.mesh_shape[axis], self.links[axis]
        # a tree only across nodes (inside a node NCCL rings); not ``link is inter_node``, which
        # also holds where a one-node calibration gave both links the same figures
        crosses = math.prod(self.mesh_shape[axis:]) > self.cluster.devices_per_node
        best = _flat(kind, nbytes, n, link, tree=crosses, ranges=self.ranges(kind.value, axis))
        split = self.splits[axis]
        if split is not None and kind is not Collective.SEND_RECV:
            m, k = split
            intra, inter = self.cluster.intra_node, self.cluster.inter_node
            rs, ag = Collective.REDUCE_SCATTER, Collective.ALL_GATHER
            if kind is Collective.ALL_REDUCE:
                t = (
                    _flat(rs, nbytes, m, intra)
                    + _flat(kind, nbytes / m, k, inter, tree=True)
                    + _flat(ag, nbytes, m, intra)
                )
            elif kind is Collective.ALL_GATHER:
                t = _flat(ag, nbytes / m, k, inter) + _flat(ag, nbytes, m, intra)
            elif kind is Collective.REDUCE_SCATTER:
                t = _flat(rs, nbytes, m, intra) + _flat(rs, nbytes / m, k, inter)
            else:  # all-to-all: every byte but 1/n crosses; the inter-node link bounds it
                t = best
            best = min(best, t)
        return best

    def queued_all_reduce_time(self, nbytes: float, axis: int) -> float:
        """Seconds of an all-reduce issued while the previous one is still in flight (the
        overlapped gradient all-reduces of ``codegen/grad_sync.py``): priced with the link's
        ``all_reduce_queued`` ranges when ``autopar calibrate`` measured them, else as
        :meth:`time` (no pipelining assumed)."""
        link = self.links[axis]
        if self.splits[axis] is None and any(r[0] == QUEUED_ALL_REDUCE for r in link.ranges):
            return collective_time(
                Collective.ALL_REDUCE,
                nbytes,
                self.mesh_shape[axis],
                link,
                self.ranges(QUEUED_ALL_REDUCE, axis),
            )
        return self.time(Collective.ALL_REDUCE, nbytes, axis)

    def reshard(
        self, src: Spec, dst: Spec, nbytes: float, requires_grad: bool, f_axes: Sequence[int] = ()
    ) -> tuple[float, list[str]]:
        """Forward + backward seconds to move a tensor of ``nbytes`` (global) from src to dst, plus
        the backward all-reduce of every Megatron "f" on ``f_axes``; and a list of the collectives."""
        key = (tuple(src), tuple(dst), nbytes, requires_grad, tuple(f_axes))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._reshard(*key)
        return hit[0], list(hit[1])

    def _reshard(self, src, dst, nbytes, requires_grad, f_axes) -> tuple[float, list[str]]:
        local = nbytes / _volume(src, self.mesh_shape)  # bytes one rank holds now
        t, names = 0.0, []
        f_axes = set(f_axes)
        # gathers / reductions first (the tensor grows), then slices (it shrinks): the same order as codegen
        order = sorted(range(len(src)), key=lambda a: not is_replicate(dst[a]))
        for a in order:
            s, d, n = src[a], dst[a], self.mesh_shape[a]
            if n == 1 or s == d:
                continue
            if is_shard(s) and is_replicate(d):
                full = local * n
                t += self.time(Collective.ALL_GATHER, full, a)
                names.append(f"all_gather@{a}")
                if requires_grad and a in f_axes:  # fused: reduce-scatter replaces f's all-reduce + slice
                    t += self.time(Collective.REDUCE_SCATTER, full, a)
                    names.append(f"reduce_scatter(bwd)@{a}")
                    f_axes.discard(a)
                local = full
            elif is_partial(s) and is_replicate(d):
                t += self.time(Collective.ALL_REDUCE, local, a)
                names.append(f"all_reduce@{a}")
            elif is_replicate(s) and is_shard(d):
                if requires_grad:
                    t += self.time(Collective.ALL_GATHER, local, a)
                    names.append(f"all_gather(bwd)@{a}")
                local = local / n
            elif is_partial(s) and is_shard(d):
                t += self.time(Collective.REDUCE_SCATTER, local, a)
                names.append(f"reduce_scatter@{a}")
                if requires_grad:
                    t += self.time(Collective.ALL_GATHER, local, a)
                    names.append(f"all_gather(bwd)@{a}")
                local = local / n
            elif is_shard(s) and is_shard(d):
                full = local * n
                t += self.time(Collective.ALL_GATHER, full, a) * (2 if requires_grad else 1)
                names.append(f"all_gather@{a}")
            elif is_shard(s) and is_partial(d):
                t += self.time(Collective.ALL_GATHER, local * n, a)
                names.append(f"all_gather@{a}")
                local = local * n
            # R -> P: a local mask forward, identity backward: free
        if requires_grad:
            for a in sorted(f_axes):
                if self.mesh_shape[a] > 1:
                    t += self.time(Collective.ALL_REDUCE, local, a)
                    names.append(f"all_reduce(bwd)@{a}")
        return t, names


def _flat(
    kind: Collective, nbytes: float, n: int, link: LinkSpec, tree: bool = False, ranges: str | None = None
) -> float:
    """One level: ring, or (across nodes) tree for all-reduce when that is cheaper; ``ranges``: the
    link's ranges to price the ring with (``collective_time``)."""
    t = collective_time(kind, nbytes, n, link, ranges)
    if tree and kind is Collective.ALL_REDUCE:
        t = min(t, tree_all_reduce_time(nbytes, n, link))
    return t


def _volume(spec: Spec, mesh_shape: Sequence[int]) -> int:
    v = 1
    for p, n in zip(spec, mesh_shape):
        if is_shard(p):
            v *= n
    return v
