"""What one use of a tensor costs and may take: its reshard and "f" seconds (a gradient bucket's
share where the "f" is a pure data-parallel one), the collective matmuls that hide part of them,
and which placement pairs data parallelism allows.

``passes/costs.py:build_costs`` prices every edge pair with these; ``passes/grad_sync.py`` and
``passes/price.py`` price a chosen plan's uses with the same functions, so tables and replays agree.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence

import torch
import torch.fx as fx

from autopar.cluster import ClusterSpec
from autopar.cost_model.comm import CommModel
from autopar.passes.analyze import NodeInfo
from autopar.passes.collective_matmul import fused_steps, overlap_saving_s
from autopar.passes.rules import writes_inputs
from autopar.passes.strategies import AxisRole, Strategy
from autopar.passes.trace import Role, TracedGraph
from autopar.placement import is_replicate, is_shard, volume_factor
from autopar.reshard import Collective, reshard_plan

aten = torch.ops.aten


@functools.cache
def f_axes(s: Strategy, i: int) -> tuple[int, ...]:
    """Axes on which input ``i`` is Replicate while the op is split: Megatron "f" goes there."""
    return tuple(a for a, split in enumerate(s.split_axes()) if split and is_replicate(s.ins[i][a]))


def pinned_axes(info: NodeInfo, axis_roles) -> list[int]:
    """Tensor-parallel axes: there a weight (2+ dims) is used where it is stored (never gathered)."""
    if info.role is not Role.PARAM or not axis_roles or len(info.shape) < 2:
        return []
    return [a for a, r in enumerate(axis_roles) if r is AxisRole.TENSOR]


# Bytes per gradient bucket (``passes/grad_sync.py:grad_buckets``): DistributedDataParallel's
# default ``bucket_cap_mb=25`` (torch/nn/parallel/distributed.py). Larger buckets pay the latency
# of fewer collectives; smaller ones start reducing earlier in backward.
BUCKET_BYTES = 25 * 2**20


def trainable_bytes(tg: TracedGraph, infos: dict[str, NodeInfo]) -> float:
    """Bytes of every parameter that takes a gradient: what gradient buckets hold at most."""
    return float(
        sum(
            infos[p.name].out_bytes
            for p in tg.placeholders
            if p.role is Role.PARAM and infos[p.name].requires_grad
        )
    )


def bucket_fixed_s(comm: CommModel, axis: int) -> float:
    """Seconds of an all-reduce of nothing on ``axis``: the part of a bucket's all-reduce that does
    not grow with its bytes (the ILP pays it once per axis, ``CostTables.bucket_fixed``)."""
    return comm.time(Collective.ALL_REDUCE, 0.0, axis)


def bucketed_axes(have, need, f: Sequence[int], axes: Collection[int]) -> tuple[int, ...]:
    """Axes of a parameter use's "f" that the tables price as a gradient bucket's share: the pure
    ones (stored as used; a fused gather + reduce-scatter stays inline) among ``axes``, the mesh's
    data-parallel axes (``CostTables.bucket_fixed``). Only there is every weight's gradient
    certain to join a bucket: elsewhere the few that do (a norm's weight beside tensor-parallel
    matmuls) would be priced a share of a bucket they do not fill."""
    return tuple(a for a in f if a in axes and have[a] == need[a])


def flatten_s(nbytes: float, cluster: ClusterSpec) -> float:
    """Seconds of flattening ``nbytes`` of gradients into a bucket's one tensor: each byte read and
    written once (``torch.cat``; the gradients then become views of it, no copy back)."""
    return 2 * nbytes / cluster.device.memory_bandwidth * cluster.compute_slowdown


# the largest output whose deferred all-reduce is priced off the step's path: a scalar (a loss)
DEFERRED_OUTPUT_BYTES = 8


def deferred_output(calls: Sequence) -> bool:
    """Whether the collectives that bring a graph output to the caller (``calls``, the reshard's)
    run off the step's path: one all-reduce of a scalar (a Partial loss summed over one axis),
    which the generated forward neither runs nor waits for (``codegen/module.py:defer_output_sums``:
    started at the forward's end and waited for where the caller reads it, or carried by
    backward's first gradient bucket). The output edge then costs no seconds
    (``passes/costs.py``) and adds no wait for the slowest rank at the forward's end
    (``passes/price.py``). A larger output (Partial logits returned whole) is deferred too, but its
    bytes still cross the link while backward runs, and a caller that returns it reads it: priced
    as before."""
    return (
        len(calls) == 1
        and calls[0].kind is Collective.ALL_REDUCE
        and calls[0].nbytes <= DEFERRED_OUTPUT_BYTES
    )


def use_price(
    comm: CommModel,
    have,
    need,
    nbytes: float,
    rg: bool,
    f: Sequence[int],
    grad_total: float = 0.0,
    axes: Collection[int] = (),
) -> tuple[float, list[str], tuple[int, ...]]:
    """Seconds the tables charge a use for resharding its input and for the "f" all-reduces of its
    gradient (``CommModel.reshard``). ``grad_total`` > 0: the input is a trainable parameter of a
    model whose trainable parameters hold that many bytes. Its pure "f" on the data-parallel
    ``axes`` (``bucketed_axes``) goes
    to a gradient bucket (``passes/grad_sync.py:grad_buckets``): it pays its share of the bucket's
    all-reduce beyond the fixed part, and of flattening the bucket (``flatten_s``),

        share = (t_AR(B) - t_AR(0)) * b / B + 2 b / memory_bandwidth * slowdown,
        B = min(BUCKET_BYTES, T / v)                                                          [s]

    with ``b`` its local bytes, ``T = grad_total`` and ``v`` the pieces its placement cuts it into;
    the ILP adds ``t_AR(0)`` once per axis where any use does this (``bucket_fixed_s``). The shares
    of parameters that fill one bucket add up to its price: exact for data parallelism up to
    ``BUCKET_BYTES`` of gradients, one ``t_AR(0)`` short per further bucket. Chosen plans are priced
    bucket by bucket as they run (``passes/grad_sync.py:price_grad_sync``). Returns the seconds
    and the axes priced as bucket shares."""
    mesh = comm.mesh_shape
    pure = bucketed_axes(have, need, f, axes) if grad_total and rg else ()
    t, _ = comm.reshard(have, need, nbytes, rg, tuple(a for a in f if a not in pure) if pure else f)
    if pure:
        vol = volume_factor(need, mesh)
        local = nbytes / vol
        full = min(BUCKET_BYTES, grad_total / vol)
        for a in pure:
            t += max(comm.time(Collective.ALL_REDUCE, full, a) - bucket_fixed_s(comm, a), 0.0) * local / full
        t += flatten_s(local, comm.cluster)
    return t, pure


def overlap_price(
    comm: CommModel,
    user: fx.Node,
    k: int,
    inp: fx.Node,
    have,
    need,
    nbytes: float,
    rg: bool,
    f: Sequence[int],
    matmul_s,
    user_out,
    state: bool = False,
    grid: tuple[bool, bool] = (False, False),
) -> float:
    """Seconds a use's collective matmuls hide (``passes/collective_matmul.py``): 0 where none
    fuses; its price is ``use_price`` less these. ``matmul_s(linear)``: the linear's tabled
    compute under the strategy in question; ``user_out``: ``user``'s output placement under it;
    ``state``: ``inp`` is a parameter or buffer; ``grid``: ``collective_matmul.fused_steps``'s."""
    fused = use_fusions(comm, user, k, inp, have, need, nbytes, f, user_out, state, grid)
    return overlap_saving_s(comm, fused, matmul_s, rg) if fused else 0.0


def use_fusions(
    comm: CommModel, user, k, inp, have, need, nbytes, f, user_out, state=False, grid=(False, False)
):
    """The collective matmuls of a use (``overlap_price``'s arguments): ``collective_matmul.fused_steps``
    of its reshard plan."""
    steps = reshard_plan(tuple(have), tuple(need), comm.mesh_shape, nbytes, tuple(f)).steps
    return fused_steps(user, k, inp, steps, user_out, state, grid)


def data_parallel_pair(have, need, param: bool, data_axes: Sequence[int]) -> bool:
    """May a use take a tensor stored as ``have`` in placement ``need`` under data parallelism on
    ``data_axes`` (``AxisRole.DATA``)? There a split activation is never gathered or re-split (the
    batch stays split, every op runs on its rows) and a parameter is used whole, as stored; a
    pending sum may be reduced (a mean loss) and a replicated tensor sliced (a mask built whole).
    Uses that cannot take a piece are not checked (``takes_whole``)."""
    for a in data_axes:
        if have[a] != need[a] and (param or is_shard(have[a])):
            return False
    return True


def data_role_takes(node: fx.Node, i: int, info: NodeInfo, have, need, param: bool, data_axes) -> bool:
    """May input ``i`` of ``node`` (the tensor ``info``), stored as ``have``, be taken as ``need``
    under data parallelism on ``data_axes``? The test ``_edge`` prices the pair by (a forbidden pair
    is infinite): ``data_parallel_pair`` unless the use takes its input whole (``takes_whole``,
    ``indexes_whole``)."""
    if takes_whole(node) or indexes_whole(node, i, info):
        return True
    return data_parallel_pair(have, need, param, data_axes)


# ops that read only their input's dtype and device (``x.new_zeros(shape)``)
_METADATA_ONLY = frozenset(
    [aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default]
)


def takes_whole(node: fx.Node) -> bool:
    """May ``node`` take its inputs whole whatever the plan: an in-place op (it may write into a
    buffer kept whole, as T5 shifts its labels into one; the buffer it writes into is taken as
    stored, ``strategies.takes_as_stored``), or one that reads only its input's metadata
    (``_METADATA_ONLY``)?"""
    return node.target in _METADATA_ONLY or writes_inputs(node)


def indexes_whole(node: fx.Node, i: int, info: NodeInfo) -> bool:
    """Is input ``i`` of ``node`` an integer or boolean tensor that ``aten.index`` looks up whole?
    Hugging Face builds its padding masks as ``mask[batch_idx, kv_idx]``: the batch indices pick
    rows of the whole mask, which no rule runs on a slice of them, so under data parallelism the
    (small, integer) mask is gathered; floating tensors never are."""
    return (
        node.target is aten.index.Tensor
        and i == 0
        and info.dtype is not None
        and not info.dtype.is_floating_point
    )
