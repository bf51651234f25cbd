"""Elementwise ops (with broadcasting) and shape-preserving ops: shard any dim; Partial only
through ops linear in their Partial operand."""

from __future__ import annotations

import torch

from autopar.passes.rules import (
    AxisOption,
    OpCtx,
    P,
    R,
    _partial_ok,
    aten,
    register,
    shard_every_dim,
)
from autopar.placement import Shard

UNARY_LINEAR = [
    aten.neg.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
    aten.detach.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default,
    aten.type_as.default, aten.lift_fresh_copy.default,
]  # fmt: skip
UNARY_NONLINEAR = [
    aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.log.default, aten.tanh.default,
    aten.sigmoid.default, aten.silu.default, aten.gelu.default, aten.relu.default, aten.erf.default,
    aten.abs.default, aten.reciprocal.default, aten.sin.default, aten.cos.default, aten.pow.Tensor_Scalar,
    aten.dropout.default, aten.bitwise_not.default, aten.logical_not.default, aten.clamp.default,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self, aten.eq.Tensor, aten.eq.Scalar,
    aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar, aten.le.Tensor, aten.le.Scalar,
    aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar, aten.__and__.Tensor, aten.__or__.Tensor,
    aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.logical_and.default, aten.logical_or.default,
    aten.maximum.default, aten.minimum.default, aten.pow.Tensor_Tensor, aten.fill.Scalar,
    aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.min.other, aten.max.other, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
]  # fmt: skip


@register(*UNARY_NONLINEAR)
def elementwise_rule(ctx: OpCtx) -> list[AxisOption]:
    return shard_every_dim(ctx)


@register(*UNARY_LINEAR)
def unary_linear_rule(ctx: OpCtx) -> list[AxisOption]:
    opts = shard_every_dim(ctx)
    val = ctx.node.meta["val"]
    if val.dtype.is_floating_point:
        opts.append(AxisOption(P, (P,)))
    return opts


@register(aten.add.Tensor, aten.sub.Tensor)
def add_rule(ctx: OpCtx) -> list[AxisOption]:
    opts = shard_every_dim(ctx)
    # sum of partials is partial (`alpha` is a scalar and keeps linearity); x + c with a Python scalar c
    # is not: summing x_r + c over n ranks gives x + n c
    if ctx.n_in == 2 and _partial_ok(ctx):
        opts.append(AxisOption(P, (P, P)))
    return opts


@register(aten.add.Scalar, aten.sub.Scalar)
def add_scalar_rule(ctx: OpCtx) -> list[AxisOption]:
    return shard_every_dim(ctx)  # x + c is not linear in x: no Partial


@register(aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar)
def mul_rule(ctx: OpCtx) -> list[AxisOption]:
    opts = shard_every_dim(ctx)
    if not ctx.node.meta["val"].dtype.is_floating_point:
        return opts
    first_is_tensor = isinstance(ctx.args[0], torch.Tensor)
    if ctx.n_in == 1:
        opts.append(AxisOption(P, (P,)))
    elif ctx.n_in == 2:
        opts.append(AxisOption(P, (P, R)))  # partial * replicated (or partial / replicated)
        if ctx.node.target is aten.mul.Tensor and first_is_tensor:
            opts.append(AxisOption(P, (R, P)))
    return opts


@register(aten.broadcast_tensors.default)
def broadcast_tensors_rule(ctx: OpCtx) -> list[AxisOption]:
    """Every output has the broadcast shape: shard any of its dims; each input follows through
    broadcasting (a size-1 or missing dim stays whole) and every output takes the shard. Linear
    in each input alone, so a Partial input broadcasts to a Partial output only with all others."""
    shape = tuple(torch.broadcast_shapes(*ctx.in_shapes))
    nd = len(shape)
    opts = []
    for d in range(nd):
        if shape[d] <= 1:
            continue
        ins = []
        for in_shape in ctx.in_shapes:
            j = d - (nd - len(in_shape))
            ins.append(Shard(j) if j >= 0 and in_shape[j] == shape[d] else R)
        opts.append(AxisOption(Shard(d), tuple(ins)))
    return opts


@register(aten.copy.default)
def copy_rule(ctx: OpCtx) -> list[AxisOption]:
    """``copy(self, src)``: ``src`` broadcast to ``self``'s shape, whose values it never reads: any dim
    split as elementwise ops split it, or a sum pending in both (the result is ``src``, linear in it).
    ``copy_``, its in-place twin, writes into ``self`` placed as the output is
    (``rules.in_place_options``): DeepSeek-V3's MLA fills slices of a ``new_empty`` so."""
    opts = shard_every_dim(ctx)
    if _partial_ok(ctx) and ctx.n_in == 2:
        opts.append(AxisOption(P, (P, P)))
    return opts
