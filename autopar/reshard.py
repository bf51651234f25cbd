"""One reshard plan: the steps that move a tensor from one placement to another on a mesh.

``reshard_plan(src, dst, mesh_shape, nbytes, f_axes)`` is the single description of a reshard:
codegen (``codegen/lower.py:emit_reshard``) emits exactly its steps, the communication model
(``cost_model/comm.py:CommModel.reshard``) prices exactly their collectives, and the memory model
(``cost_model/memory.py:reshard_transient``) sizes exactly their transients.

Steps go axis by axis: first the axes whose target is Replicate (the tensor grows: gathers and
reductions), then the others (it shrinks: slices), each axis in mesh order within the two groups;
then the Megatron "f" (identity forward, all-reduce backward; Shoeybi et al. 2019) of every axis
in ``f_axes`` that no gather absorbed. Each step is one call of an autograd-aware function of
``codegen/collectives.py`` (``StepKind``). Gradient convention: the gradient of a Replicate or
Partial value is the full gradient on every rank, that of a Shard value is the shard.

With ``L`` the bytes one rank holds before a step and ``n`` the axis size (``B`` below, the
bytes a collective is priced at, is the full tensor over the axis: the comm model's convention):

==============  ================================  =========================================
src -> dst      forward                           backward (when the tensor needs a gradient)
==============  ================================  =========================================
S(d) -> R       all-gather (B = n L)              local slice; reduce-scatter (B = n L) when
                                                  it absorbs the axis's "f" (``fused_f``)
R -> S(d)       local slice                       all-gather (B = L)
P -> R          all-reduce (B = L)                nothing
P -> S(d)       reduce-scatter (B = L)            all-gather (B = L)
R -> P          keep on coordinate 0 (local)      nothing
S(d) -> S(e)    all-gather (n L), local slice     all-gather (n L), local slice
S(d) -> P       all-gather (n L), keep on coord 0 local slice
"f" on axis a   nothing                           all-reduce (B = L of the final placement)
==============  ================================  =========================================

Bytes each step holds while it runs (what ``codegen/collectives.py`` allocates; gloo's
reduce-scatter is an all-reduce of a clone and a slice, and NCCL's needs no more):

============  ===========================================  ====================================
step          forward: live while it runs                  backward: live while it runs
============  ===========================================  ====================================
all-gather    input L + output n L, on dim 0; on another   gradient n L + slice L; fused with
              dim input L + parts n L + output n L         an "f" (reduce-scatter): n L + n L
              (``cat``)                                    (gloo: all-reduce's clone) + L
all-reduce    input L + clone L                            nothing (identity)
chunk         input L + contiguous slice L / n             gradient L / n + (parts L) + output L
reduce-scat.  input L + clone L + slice L / n (gloo)       gradient L / n + (parts L) + output L
to_partial    input L + clone (or zeros) L                 nothing (identity)
f             nothing (a view)                             gradient L + all-reduce's clone L
============  ===========================================  ====================================

A gather along dim 0 runs straight into its output (``all_gather_single``): no parts (those in
parentheses are for gathers along other dims). A reshard's transient is the largest of these over
its steps, forward and backward (backward only when the tensor needs a gradient); in forward the
last step's output is left out when the consumer keeps it for backward (it is then counted as
kept memory, ``passes/costs.py``). The input is always counted: a consumer that reshards a tensor
usually is not what keeps the original.

Not modeled: the backend's worker thread holds a collective's tensors until it lets go of the
work, after the caller has been told it is done; where ranks outnumber cores that can be a while.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor.placement_types import Placement, Replicate

from autopar.placement import Spec, is_partial, is_replicate, is_shard, volume_factor


class Collective(enum.Enum):
    """The collectives the cost model prices."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"
    BROADCAST = "broadcast"  # one rank's tensor to every rank of the axis (SUMMA's steps)
    REDUCE = "reduce"  # the sum of the axis's tensors to one rank


class AxisGroup(enum.Enum):
    """The ranks of one mesh axis's group a collective runs over: all of them (``WHOLE``), or, on an
    axis whose group spans whole nodes (``m`` of its ranks in each), the ranks with this rank's
    local index, one per node (``RAIL``: the inter-node link), or the ``m`` of this rank's node
    (``NODE``: the intra-node link). The node-deduplicated expert dispatch issues the last two
    (``codegen/experts_nodes.py``)."""

    WHOLE = "whole"
    RAIL = "rail"
    NODE = "node"


def axis_nodes(mesh_shape: Sequence[int], axis: int, devices_per_node: int) -> tuple[int, int] | None:
    """(m, k) when the groups of mesh axis ``axis`` span k > 1 whole nodes of ``devices_per_node``
    devices with m of the axis's ranks in each (ranks row-major over the mesh, numbered node by
    node: a group is ``mesh_shape[axis]`` ranks ``stride = prod(mesh_shape[axis+1:])`` apart, and
    ``stride * m = devices_per_node``); None otherwise."""
    stride = math.prod(mesh_shape[axis + 1 :])
    n, d = mesh_shape[axis], devices_per_node
    if stride >= d or stride * n <= d or d % stride or n % (d // stride):
        return None
    m = d // stride
    return m, n // m


def expert_nodes(mesh_shape: Sequence[int], axis: int, devices_per_node: int) -> tuple[int, int] | None:
    """(m, N) for the expert dispatch once per node (``AxisGroup``): ``axis_nodes``, or, where each
    of the axis's ``n > 1`` ranks lies in a node of its own (its stride a multiple of the node),
    ``(1, n)``: every rail is the whole group, every node one rank. None where the group does not
    span whole nodes."""
    split = axis_nodes(mesh_shape, axis, devices_per_node)
    if split is not None:
        return split
    stride, n = math.prod(mesh_shape[axis + 1 :]), mesh_shape[axis]
    return (1, n) if n > 1 and stride % devices_per_node == 0 else None


class Phase(enum.Enum):
    """When a collective runs in a training step."""

    FORWARD = "forward"
    BACKWARD = "backward"


class StepKind(enum.Enum):
    """The autograd-aware functions of ``codegen/collectives.py`` a reshard calls."""

    ALL_GATHER = "all_gather"
    CHUNK = "chunk"
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    TO_PARTIAL = "to_partial"
    F = "f"


@dataclass(frozen=True)
class CollectiveCall:
    """One collective a step runs: on mesh axis ``axis``, priced at ``nbytes`` (the full tensor
    over the axis, bytes), in forward or in backward."""

    kind: Collective
    axis: int
    nbytes: float
    phase: Phase
    group: AxisGroup = AxisGroup.WHOLE  # the part of the axis's group it runs over

    def __post_init__(self) -> None:
        if self.axis < 0 or self.nbytes < 0:
            raise ValueError(f"bad collective call {self}: axis and bytes must be >= 0")


@dataclass(frozen=True)
class ReshardStep:
    """One call of a ``codegen/collectives.py`` function: what it runs and what it holds.

    ``dim``: the tensor dim it gathers or slices (None for all-reduce, to_partial, f);
    ``fused_f``: an all-gather whose backward reduce-scatters, absorbing the axis's "f";
    ``live_fwd``: bytes live while its forward runs (None: nothing runs, a view);
    ``out_bytes``: bytes of its output; ``live_bwd``: bytes live while its backward runs."""

    kind: StepKind
    axis: int
    dim: int | None
    fused_f: bool
    forward: CollectiveCall | None
    backward: CollectiveCall | None
    live_fwd: float | None
    out_bytes: float
    live_bwd: float


@dataclass(frozen=True)
class ReshardPlan:
    """The steps that move a tensor of ``nbytes`` (global) from ``src`` to ``dst``."""

    steps: tuple[ReshardStep, ...]

    def collectives(self, requires_grad: bool) -> tuple[CollectiveCall, ...]:
        """The collectives the steps run, each step's forward then its backward (backward ones only
        when the tensor needs a gradient)."""
        out = []
        for s in self.steps:
            if s.forward is not None:
                out.append(s.forward)
            if s.backward is not None and requires_grad:
                out.append(s.backward)
        return tuple(out)

    def transient(self, requires_grad: bool, keeps: bool = False) -> float:
        """Largest bytes per device the steps hold at once, forward or backward; 0 when nothing
        runs. ``keeps``: the consumer keeps the result until backward (the last forward step's
        output is counted there, not here)."""
        fwd = [s for s in self.steps if s.live_fwd is not None]
        peak = 0.0
        for k, s in enumerate(fwd):
            peak = max(peak, s.live_fwd - (s.out_bytes if keeps and k == len(fwd) - 1 else 0.0))
        if requires_grad:
            # a step whose backward is an identity holds nothing (0); "f" and the slices do
            peak = max([peak, *(s.live_bwd for s in self.steps)])
        return peak


def _gathered(dim: int, full: float) -> float:
    """Bytes an all-gather of ``full`` bytes along ``dim`` allocates: the output, and on a dim
    other than 0 the parts it concatenates (``codegen/collectives.py``)."""
    return full if dim == 0 else 2 * full


def _slices_held_dim(
    cur: Sequence[Placement], d: Placement, axis: int, dst: Sequence[Placement], mesh_shape: Sequence[int]
) -> bool:
    """Would moving ``axis`` to ``d`` slice a tensor dim another axis (of more than one rank) holds
    sharded now? A dim the target splits on several axes (nested, as DTensor nests them: the lower
    axis outer) may be sliced on ``axis`` under an outer axis that holds its target split already."""
    if not is_shard(d):
        return False
    return any(
        b != axis
        and mesh_shape[b] > 1
        and is_shard(p)
        and p.dim == d.dim
        and not (b < axis and d == dst[axis] and p == dst[b])
        for b, p in enumerate(cur)
    )


def _gathers_outer(cur: Sequence[Placement], axis: int, mesh_shape: Sequence[int]) -> bool:
    """Would gathering ``axis`` gather a dim an inner axis (of more than one rank) also splits
    (nested)? Its pieces would interleave: the inner axis must be gathered first."""
    p = cur[axis]
    return is_shard(p) and any(
        is_shard(q) and q.dim == p.dim and mesh_shape[b] > 1 for b, q in enumerate(cur) if b > axis
    )


@functools.lru_cache(maxsize=1 << 16)
def reshard_plan(
    src: Spec, dst: Spec, mesh_shape: tuple[int, ...], nbytes: float = 0.0, f_axes: tuple[int, ...] = ()
) -> ReshardPlan:
    """The steps that move a tensor of ``nbytes`` (global) from placement ``src`` to ``dst`` on a
    mesh of ``mesh_shape``, then the "f" of each axis of ``f_axes`` (module docstring).
    ``nbytes`` only sizes the steps: codegen, which needs only the steps, may pass 0."""
    src, dst, mesh_shape = tuple(src), tuple(dst), tuple(mesh_shape)
    fwd, bwd = Phase.FORWARD, Phase.BACKWARD
    AG, AR, RS = Collective.ALL_GATHER, Collective.ALL_REDUCE, Collective.REDUCE_SCATTER
    local = nbytes / volume_factor(src, mesh_shape)  # bytes one rank holds now
    steps: list[ReshardStep] = []
    pending_f = set(f_axes)
    # the placement the steps so far leave (an axis of one rank holds the whole tensor either way)
    cur = [d if n == 1 else s for s, d, n in zip(src, dst, mesh_shape)]
    # the axes to move, in the order preferred: Replicate targets first (the tensor grows), then
    # the others, each group in mesh order
    pending = sorted(
        (a for a in range(len(src)) if mesh_shape[a] > 1 and src[a] != dst[a]),
        key=lambda a: not is_replicate(dst[a]),
    )
    rounds = 0
    while pending:
        rounds += 1
        if rounds > 3 * len(src) + 2:
            # a nesting the order below cannot untangle (each axis moves at most three times on
            # any path it finds): gather to whole, innermost axis first, then cut to ``dst``, outer
            # axis first; a correct path, if not the cheapest, never a loop without end
            whole = (Replicate(),) * len(src)
            there = reshard_plan(src, whole, mesh_shape, nbytes).steps
            return ReshardPlan(there + reshard_plan(whole, dst, mesh_shape, nbytes, f_axes).steps)
        # the first axis in order whose step does not slice a dim another axis still holds
        # sharded (that would cut the other axis's piece, not the tensor: wrong rows, or a dim of
        # one row cut in two), nor gathers a dim an inner axis splits too; where every pending
        # step would, the first shard that can be is gathered first (a pending axis's, else one
        # whose target it is already: it is then pending again)
        a = next(
            (
                a
                for a in pending
                if not _slices_held_dim(cur, dst[a], a, dst, mesh_shape)
                and not _gathers_outer(cur, a, mesh_shape)
            ),
            None,
        )
        if a is None:
            # first an axis whose shard holds the dim a pending step must slice (an inner axis
            # holding the dim a nested target splits on an outer one: (R, R, S(1)) -> (S(0), S(1),
            # S(1)) gathers axis 2 first); gathering any other shard would not unblock it, and
            # the step that re-cut it would come round again, for ever
            blockers = [
                b
                for b in range(len(cur))
                if is_shard(cur[b])
                and any(
                    b != c and cur[b].dim == getattr(dst[c], "dim", None)  # c would slice b's dim
                    or c < b and is_shard(cur[c]) and cur[c].dim == cur[b].dim  # c would gather outer
                    for c in pending
                )
            ]
            a = next(
                b
                for b in [*blockers, *pending, *range(len(cur))]
                if is_shard(cur[b]) and mesh_shape[b] > 1 and not _gathers_outer(cur, b, mesh_shape)
            )
            if a not in pending:
                pending = sorted([*pending, a], key=lambda b: (not is_replicate(dst[b]), b))
            d = Replicate()
        else:
            d = dst[a]
            pending.remove(a)
        s, n = cur[a], mesh_shape[a]
        cur[a] = d
        if is_shard(s):
            full = local * n
            fused = d == dst[a] and is_replicate(d) and a in pending_f
            if fused:
                pending_f.discard(a)
            back = CollectiveCall(RS, a, full, bwd) if fused else None
            live_bwd = 2 * full + local if fused else full + local
            steps.append(
                ReshardStep(StepKind.ALL_GATHER, a, s.dim, fused, CollectiveCall(AG, a, full, fwd), back,
                            local + _gathered(s.dim, full), full, live_bwd)
            )  # fmt: skip
            if is_shard(d):  # then a slice of the gathered tensor
                steps.append(
                    ReshardStep(StepKind.CHUNK, a, d.dim, False, None, CollectiveCall(AG, a, full, bwd),
                                full + local, local, local + _gathered(d.dim, full))
                )  # fmt: skip
            elif is_partial(d):  # then keep it on coordinate 0: a clone (or zeros)
                steps.append(
                    ReshardStep(StepKind.TO_PARTIAL, a, None, False, None, None, 2 * full, full, 0.0)
                )
                local = full
            else:
                local = full
        elif is_partial(s) and is_replicate(d):
            steps.append(
                ReshardStep(StepKind.ALL_REDUCE, a, None, False, CollectiveCall(AR, a, local, fwd), None,
                            2 * local, local, 0.0)
            )  # fmt: skip
        elif is_replicate(s) and is_shard(d):
            steps.append(
                ReshardStep(StepKind.CHUNK, a, d.dim, False, None, CollectiveCall(AG, a, local, bwd),
                            local + local / n, local / n, local / n + _gathered(d.dim, local))
            )  # fmt: skip
            local = local / n
        elif is_partial(s) and is_shard(d):
            steps.append(
                ReshardStep(StepKind.REDUCE_SCATTER, a, d.dim, False, CollectiveCall(RS, a, local, fwd),
                            CollectiveCall(AG, a, local, bwd), 2 * local + local / n, local / n,
                            local / n + _gathered(d.dim, local))
            )  # fmt: skip
            local = local / n
        elif is_replicate(s) and is_partial(d):
            steps.append(ReshardStep(StepKind.TO_PARTIAL, a, None, False, None, None, 2 * local, local, 0.0))
        else:
            raise ValueError(f"no reshard from {s} to {d} on mesh axis {a}")
    for a in sorted(pending_f):
        if mesh_shape[a] > 1:
            steps.append(
                ReshardStep(StepKind.F, a, None, False, None, CollectiveCall(AR, a, local, bwd), None, local,
                            2 * local)
            )  # fmt: skip
    return ReshardPlan(tuple(steps))
