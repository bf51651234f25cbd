"""Embedding (hidden- and vocabulary-parallel), norms, softmax, attention (batch, heads, query
rows), cross-entropy, and reductions (a sharded reduced dim gives Partial)."""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement, Shard

from autopar.passes.rules import (
    AxisOption,
    OpCtx,
    P,
    R,
    _partial_ok,
    aten,
    norm_dim,
    register,
    shard_every_dim,
)
from autopar.placement import SeqAttention, is_shard

# embedding, norms, softmax, attention, loss


@register(aten.embedding.default)
def embedding_rule(ctx: OpCtx) -> list[AxisOption]:
    ids = ctx.in_shapes[1]
    opts = [AxisOption(Shard(d), (R, Shard(d))) for d in range(len(ids)) if ids[d] > 1]
    opts.append(AxisOption(Shard(len(ids)), (Shard(1), R)))  # hidden-parallel table
    if _partial_ok(ctx) and not ctx.arg(4, "sparse", False):
        opts.append(AxisOption(P, (Shard(0), R)))  # vocabulary-parallel: masked lookup (codegen/local_ops.py)
    return opts


@register(aten.layer_norm.default, aten.rms_norm.default)
def layer_norm_rule(ctx: OpCtx) -> list[AxisOption]:
    normalized = ctx.arg(1, "normalized_shape")
    nd = len(ctx.out_shape)
    k = len(normalized)
    opts = []
    for d in range(nd - k):
        if ctx.out_shape[d] > 1:
            opts.append(AxisOption(Shard(d), (Shard(d),) + (R,) * (ctx.n_in - 1)))
    return opts


@register(aten.batch_norm.default)
def batch_norm_rule(ctx: OpCtx) -> list[AxisOption]:
    """``batch_norm(x, weight?, bias?, running_mean?, running_var?, training, momentum, eps, ...)``
    with per-channel tensors on x's dim 1. Any other dim of ``x`` may be split, the per-channel
    tensors whole: in training the statistics over the split dims are all-reduced (SyncBatchNorm,
    by the lowering in ``codegen/lower.py``), in evaluation the op is per element. Channels may be
    split with the per-channel tensors, unless training updates running statistics (buffers are
    never resharded in place: the update would be lost)."""
    x = ctx.in_shapes[0]
    training = ctx.arg(5, "training", False)
    running = ctx.arg(3, "running_mean") is not None
    if len(x) < 2 or (training and running and ctx.arg(6, "momentum", 0.1) is None):
        return []  # a cumulative average (momentum None) counts batches: replicated
    rest = (R,) * (ctx.n_in - 1)
    opts = [AxisOption(Shard(d), (Shard(d),) + rest) for d in range(len(x)) if d != 1 and x[d] > 1]
    if x[1] > 1 and not (training and running):
        opts.append(AxisOption(Shard(1), (Shard(1),) + (Shard(0),) * (ctx.n_in - 1)))
    return opts


def batch_norm_training(node: fx.Node) -> bool:
    """``node`` is an ``aten.batch_norm`` that normalizes by the statistics of its batch (training
    mode): they are all-reduced over a split batch here, and a micro-batch would have its own
    (``passes/micro_batch_check.py``)."""
    if node.op != "call_function" or node.target is not aten.batch_norm.default:
        return False
    return bool(node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False))


def batch_norm_split_axes(node: fx.Node, x_spec: Sequence[Placement], mesh_shape: Sequence[int]) -> list[int]:
    """The mesh axes over which a training ``batch_norm`` whose input is placed ``x_spec``
    all-reduces its statistics: those splitting a dim of its input other than the channels."""
    if not batch_norm_training(node):
        return []
    return [a for a, p in enumerate(x_spec) if is_shard(p) and p.dim != 1 and mesh_shape[a] > 1]


@register(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
def softmax_rule(ctx: OpCtx) -> list[AxisOption]:
    return shard_every_dim(ctx, skip=[ctx.arg(1, "dim")])


@register(aten.scaled_dot_product_attention.default)
def sdpa_rule(ctx: OpCtx) -> list[AxisOption]:
    # q [..., L, E], k/v [..., S, E]: batch and head dims, or q's rows L (k/v whole); never S or E
    q, k = ctx.in_shapes[0], ctx.in_shapes[1]
    nd = len(q)
    mask = ctx.in_shapes[3] if ctx.n_in > 3 else None
    if nd < 3 or len(k) != nd:
        return []

    def mask_pl(dim: int) -> tuple[Placement, ...]:
        if mask is None:
            return ()
        j = dim - (nd - len(mask))
        return (Shard(j) if j >= 0 and mask[j] > 1 else R,)

    opts = [AxisOption(Shard(0), (Shard(0),) * 3 + mask_pl(0))] if q[0] == k[0] else []
    # sequence parallel: this rank's query rows against every key (the K/V exchange is the all-gather
    # that brings k and v to Replicate); a causal mask is rebuilt from global positions in codegen
    if q[-2] > 1:
        opts.append(AxisOption(Shard(nd - 2), (Shard(nd - 2), R, R) + mask_pl(nd - 2)))
    if nd == 4 and (q[1] == k[1] or ctx.arg(7, "enable_gqa", False)):
        kv = Shard(1) if k[1] > 1 else R  # a single K/V head (multi-query) stays replicated
        opts.append(AxisOption(Shard(1), (Shard(1), kv, kv) + mask_pl(1)))
    return opts + _sequence_attention_options(ctx, mask_pl)


def _sequence_attention_options(ctx: OpCtx, mask_pl) -> list[AxisOption]:
    """Q, K and V all split on the sequence (``SeqAttention.RING`` and ``ALL_TO_ALL``,
    ``codegen/context_parallel.py``): self-attention shapes (as many keys as queries), no dropout.
    Ring takes any mask, split by query rows like the queries; all-to-all runs whole sequences
    of a slice of the heads, so its mask must be whole and the same for every head."""
    q, k = ctx.in_shapes[0], ctx.in_shapes[1]
    if len(q) != 4 or q[2] != k[2] or q[2] < 2 or ctx.arg(4, "dropout_p", 0.0):
        return []
    if q[1] != k[1] and not (ctx.arg(7, "enable_gqa", False) and q[1] % k[1] == 0):
        return []
    mask = ctx.in_shapes[3] if ctx.n_in > 3 else None
    seq = Shard(2)
    opts = [AxisOption(seq, (seq, seq, seq) + mask_pl(2), via=SeqAttention.RING)]
    if mask is None or len(mask) < 3 or mask[-3] == 1:
        # heads cut by the all-to-all: Q's, and K/V's unless there is one K/V head (then gathered)
        splits = ((0, 1),) if k[1] == 1 else ((0, 1), (1, 1), (2, 1))
        opts.append(
            AxisOption(
                seq, (seq, seq, seq) + ((R,) if mask else ()), via=SeqAttention.ALL_TO_ALL, splits=splits
            )
        )
    return opts


@register(aten.cross_entropy_loss.default)
def cross_entropy_rule(ctx: OpCtx) -> list[AxisOption]:
    # batch-sharded logits and targets; output is the replicated loss (lowering all-reduces sum and count)
    weight = ctx.arg(2, "weight")
    smoothing = ctx.arg(5, "label_smoothing", 0.0)
    reduction = ctx.arg(3, "reduction", 1)
    if weight is not None or smoothing or ctx.n_in != 2 or reduction not in (0, 1, 2):
        return []
    if reduction == 0:  # 'none': elementwise over the batch
        return [AxisOption(Shard(0), (Shard(0), Shard(0)))]
    return [AxisOption(R if reduction == 1 else P, (Shard(0), Shard(0)))]


@register(aten.mse_loss.default)
def mse_loss_rule(ctx: OpCtx) -> list[AxisOption]:
    """Inputs of one shape (``broadcast_tensors`` makes them so) cut alike on any dim: 'none' keeps
    the cut, 'sum' and 'mean' leave a pending sum (the lowering divides a mean by the pieces)."""
    a, b = ctx.in_shapes if ctx.n_in == 2 else ((), ())
    if not a or a != b:
        return []
    reduction = ctx.arg(2, "reduction", 1)
    return [
        AxisOption(Shard(d) if reduction == 0 else P, (Shard(d), Shard(d))) for d in range(len(a)) if a[d] > 1
    ]


@register(aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default)
def reduction_rule(ctx: OpCtx) -> list[AxisOption]:
    shape = ctx.in_shapes[0]
    nd = len(shape)
    dims = ctx.arg(1, "dim") if ctx.node.target in (aten.sum.dim_IntList, aten.mean.dim) else None
    keepdim = ctx.arg(2, "keepdim", False) if dims is not None else False
    reduced = set(range(nd)) if not dims else {norm_dim(d, nd) for d in dims}
    opts = []
    for d in range(nd):
        if shape[d] <= 1:
            continue
        if d in reduced:
            opts.append(AxisOption(P, (Shard(d),)))
        else:
            out_d = d if keepdim else d - sum(1 for r in reduced if r < d)
            opts.append(AxisOption(Shard(out_d), (Shard(d),)))
    if ctx.node.meta["val"].dtype.is_floating_point:
        opts.append(AxisOption(P, (P,)))
    return opts
