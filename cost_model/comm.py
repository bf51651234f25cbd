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
* broadcast, reduce:       B / bw + (n-1) lat (pipelined along a chain; ``B`` the tensor sent)

An axis whose groups lie inside a node takes the ``(bw, lat)`` its own group size and stride were
measured at, where ``autopar calibrate`` measured them (``group_ranges``: every group of the
axis at once, as the mesh runs them), and the full group's otherwise. These per-layout figures
(and the queued all-reduce's, ``QUEUED_ALL_REDUCE``) come only from a calibration, in practice of
CPU (gloo) ranks that share a host's cores, where the ring's ``(n-1)`` latency terms do not carry
from one group size to another (the ranks of a pair may or may not share a core); no preset
carries them, so a GPU preset's axes are priced by the formulas above alone. What they were on
the development machine: ``benchmarks/README.md``, "Readings of the development VM".

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

A reduce-scatter where the transport has none (gloo: ``NATIVE_REDUCE_SCATTER``) runs as an
all-reduce of the full tensor and a local slice (``codegen/collectives.py:_reduce_scatter``; gloo's
own ``reduce_scatter_tensor``, which FSDP2 calls, is no cheaper: 4.3 ms against the all-reduce's
4.1 ms for 64 KiB over 4 ranks on the development VM, the all-gather 2.2 ms): it is priced as that
all-reduce, not as a ring reduce-scatter at half of it, unless the link has figures measured for it
(``autopar calibrate`` times a reduce-scatter as codegen runs it).

Resharding one tensor from ``src`` to ``dst`` placements runs the steps of its reshard plan
(``autopar/reshard.py:reshard_plan``, the same steps codegen emits), forward and backward:
``CommModel.reshard`` is the sum of their collectives at the prices above.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from autopar.cluster import ClusterSpec, LinkSpec
from autopar.hardware import DeviceKind, per_kind
from autopar.placement import Spec
from autopar.reshard import AxisGroup, Collective, CollectiveCall, axis_nodes, expert_nodes, reshard_plan

# ``LinkSpec.ranges`` name of the all-reduce issued behind another one still in flight
QUEUED_ALL_REDUCE = "all_reduce_queued"

# whether the transport a device kind's ranks use runs a reduce-scatter of its own (NCCL) or an
# all-reduce and a slice (gloo: module docstring)
NATIVE_REDUCE_SCATTER = {DeviceKind.CUDA: True, DeviceKind.CPU: False}


def group_ranges(name: str, n: int, stride: int) -> str:
    """The ``LinkSpec.ranges`` name of collective ``name`` (or ``QUEUED_ALL_REDUCE``) on groups of
    ``n`` ranks ``stride`` apart inside a node, every such group at once, as a mesh axis of that
    size and stride runs it: ``"all_reduce/2x1"``. ``autopar calibrate`` measures each group a
    mesh axis of its world can have (``calibrate.group_layouts``), and ``CommModel`` prices an
    axis with its group's figures where the link has them, else with the collective's own. Only a
    calibrated link has them (of CPU ranks sharing a host's cores; no preset)."""
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
    if kind in (Collective.BROADCAST, Collective.REDUCE):  # pipelined along a chain of the n ranks
        return nbytes / bw + (n - 1) * lat
    raise ValueError(f"unknown collective {kind}")


def tree_all_reduce_time(nbytes: float, n: int, link: LinkSpec) -> float:
    """Seconds for a (double binary) tree all-reduce of ``nbytes`` over ``n`` ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = link.at(nbytes, Collective.ALL_REDUCE.value)
    return 2 * math.ceil(math.log2(n)) * lat + 2 * nbytes / bw


def node_split(cluster: ClusterSpec, mesh_shape: Sequence[int], axis: int) -> tuple[int, int] | None:
    """(m, k) when the axis's groups span k whole nodes with m ranks in each (consecutive ranks,
    ``stride * m = devices_per_node``: the hierarchical algorithm of the module docstring
    applies); None otherwise."""
    return axis_nodes(mesh_shape, axis, cluster.devices_per_node)


def crosses_nodes(mesh_shape: Sequence[int], axis: int, devices_per_node: int) -> bool:
    """Whether the groups of mesh axis ``axis`` span more than one node: ranks row-major over the
    mesh and numbered node by node, a group of the axis lies in a run of ``stride * n =
    prod(mesh_shape[axis:])`` consecutive ranks, which fits in a node or does not (the module
    docstring; the search keeps only meshes whose runs tile the nodes, ``solver.node_aligned``)."""
    return math.prod(mesh_shape[axis:]) > devices_per_node


def axis_link(cluster: ClusterSpec, mesh_shape: Sequence[int], axis: int) -> LinkSpec:
    """The link an axis's collectives run on: ``inter_node`` where its groups cross nodes
    (:func:`crosses_nodes`), else ``intra_node``."""
    crosses = crosses_nodes(mesh_shape, axis, cluster.devices_per_node)
    return cluster.inter_node if crosses else cluster.intra_node


class CommModel:
    """Prices collectives and resharding on one mesh of one cluster."""

    def __init__(self, cluster: ClusterSpec, mesh_shape: Sequence[int]):
        self.cluster = cluster
        self.mesh_shape = tuple(mesh_shape)
        self.links = [axis_link(cluster, self.mesh_shape, a) for a in range(len(self.mesh_shape))]
        self.splits = [node_split(cluster, self.mesh_shape, a) for a in range(len(self.mesh_shape))]
        # the reshards priced so far on this cluster and mesh, by value: shared by every model of
        # the same two (a search's candidates of one mesh under other axis roles price the same
        # pairs again), since a price depends on nothing else
        self._cache = _reshard_cache(cluster, self.mesh_shape)
        self._by_id: dict[tuple, tuple] = {}
        native = per_kind(
            NATIVE_REDUCE_SCATTER, cluster.device.kind, "reduce-scatter transport", "cost_model/comm.py"
        )
        # per axis: whether its reduce-scatter runs as an all-reduce, which prices it, where the link
        # has no figures measured for a reduce-scatter (module docstring)
        self._scatter_reduces = [
            not native and not any(r[0].split("/")[0] == Collective.REDUCE_SCATTER.value for r in link.ranges)
            for link in self.links
        ]

    def ranges(self, name: str, axis: int) -> str:
        """The ``LinkSpec.ranges`` name that prices collective ``name`` on ``axis``: its group's
        (``group_ranges``) where the axis's groups lie inside a node and the link has figures for
        them, else ``name``'s own."""
        link, n = self.links[axis], self.mesh_shape[axis]
        stride = math.prod(self.mesh_shape[axis + 1 :])
        if not crosses_nodes(self.mesh_shape, axis, self.cluster.devices_per_node):
            key = group_ranges(name, n, stride)
            if any(r[0] == key for r in link.ranges):
                return key
        return name

    def time(self, kind: Collective, nbytes: float, axis: int, group: AxisGroup = AxisGroup.WHOLE) -> float:
        """Seconds for one collective on ``axis``: the cheapest of ring, tree and hierarchical.
        ``group``: a rail (the axis's ranks with this rank's local index, one per node: ``k``
        ranks on the inter-node link) or a node (its ``m`` ranks on the intra-node link) of an
        axis that spans whole nodes (``node_split``), priced as a ring over those ranks. A
        reduce-scatter the transport runs as an all-reduce is priced as one (module docstring)."""
        if kind is Collective.REDUCE_SCATTER and self._scatter_reduces[axis]:
            kind = Collective.ALL_REDUCE
        if group is not AxisGroup.WHOLE:
            split = expert_nodes(self.mesh_shape, axis, self.cluster.devices_per_node)
            if split is None:
                raise ValueError(
                    f"a collective over a {group.value} of mesh axis {axis} ({self.mesh_shape}), whose groups do "
                    f"not span whole nodes of {self.cluster.devices_per_node} devices"
                )
            m, k = split
            if group is AxisGroup.RAIL:
                return _flat(kind, nbytes, k, self.cluster.inter_node)
            return _flat(kind, nbytes, m, self.cluster.intra_node)
        n, link = self.mesh_shape[axis], self.links[axis]
        # a tree only across nodes (inside a node NCCL rings); not ``link is inter_node``, which
        # also holds where a one-node calibration gave both links the same figures
        crosses = crosses_nodes(self.mesh_shape, axis, self.cluster.devices_per_node)
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
        ``all_reduce_queued`` ranges where ``autopar calibrate`` wrote them (a calibrated link, of
        CPU ranks in practice; no preset has them), else as :meth:`time` (no pipelining assumed)."""
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
    ) -> tuple[float, tuple[CollectiveCall, ...]]:
        """Forward + backward seconds to move a tensor of ``nbytes`` (global) from src to dst, plus
        the backward all-reduce of every Megatron "f" on ``f_axes``; and the collectives that run
        (``autopar/reshard.py:reshard_plan``, backward ones only when it needs a gradient)."""
        # first by identity: the search asks this of the same placement tuples hundreds of thousands
        # of times, and hashing a placement is a Python call; the entry holds the objects it was
        # keyed on, so their ids stay theirs while it lives
        tuples = type(src) is tuple and type(dst) is tuple and type(f_axes) is tuple  # never mutated
        ikey = (id(src), id(dst), nbytes, requires_grad, id(f_axes))
        same = self._by_id.get(ikey) if tuples else None
        if same is not None and same[0] is src and same[1] is dst and same[2] is f_axes:
            return same[3]
        key = (tuple(src), tuple(dst), nbytes, requires_grad, tuple(f_axes))
        hit = self._cache.get(key)
        if hit is None:
            calls = reshard_plan(key[0], key[1], self.mesh_shape, nbytes, key[4]).collectives(requires_grad)
            hit = self._cache[key] = (self.calls_time(calls), calls)
        if tuples:
            self._by_id[ikey] = (src, dst, f_axes, hit)
        return hit

    def calls_time(self, calls: Sequence[CollectiveCall]) -> float:
        """Seconds of ``calls`` run one after the other."""
        return sum(self.time(c.kind, c.nbytes, c.axis, c.group) for c in calls)


# (cluster, mesh) -> its reshards priced (``CommModel.reshard``): the last few kept
RESHARD_CACHES = 32


@functools.lru_cache(maxsize=RESHARD_CACHES)
def _reshard_cache(cluster: ClusterSpec, mesh_shape: tuple[int, ...]) -> dict:
    return {}


def _flat(
    kind: Collective, nbytes: float, n: int, link: LinkSpec, tree: bool = False, ranges: str | None = None
) -> float:
    """One level: ring, or (across nodes) tree for all-reduce when that is cheaper; ``ranges``: the
    link's ranges to price the ring with (``collective_time``)."""
    t = collective_time(kind, nbytes, n, link, ranges)
    if tree and kind is Collective.ALL_REDUCE:
        t = min(t, tree_all_reduce_time(nbytes, n, link))
    return t
