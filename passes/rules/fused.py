"""Sharding rules of autopar's fused ops (``kernels/``, substituted by ``passes/fuse.py``).

Each fused op computes the same values as the aten pattern it replaces, so its rules are that
pattern's, read as one op:

* ``rms_norm`` / ``layer_norm`` (x, residual?, weight?, bias?) -> (normalized, x + residual): any
  dim but the normalized last one, on x and the residual alike; weight and bias whole.
* ``swiglu`` / ``geglu`` (gate, up): elementwise on equal shapes: any dim.
* ``rope`` (x, cos, sin): any dim but the rotated last one (its halves are exchanged); cos and
  sin follow through broadcasting.
* ``linear_cross_entropy`` (h [N, H], W [V, H], labels [N]): rows split (h and labels on dim 0):
  a mean leaves this rank's sum and token count, all-reduced by the lowering (``codegen/lower.py``,
  as for ``cross_entropy_loss``); a sum is a pending sum. The vocabulary split (W on dim 0, h and
  labels whole): Megatron's vocabulary-parallel cross-entropy, which all-reduces each row's max,
  sum of exponentials and target logit inside the op (``kernels/cross_entropy.py``); the loss comes
  out whole.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from autopar.kernels import ops as kernel_ops
from autopar.passes.rules import AxisOption, OpCtx, P, R, _partial_ok, register, shard_every_dim

kernel_ops.load()
autopar = torch.ops.autopar


@register(autopar.rms_norm.default, autopar.layer_norm.default)
def fused_norm_rule(ctx: OpCtx) -> list[AxisOption]:
    x = ctx.in_shapes[0]
    return [
        AxisOption(Shard(d), tuple(Shard(d) if s == x else R for s in ctx.in_shapes))
        for d in range(len(x) - 1)
        if x[d] > 1
    ]


@register(autopar.swiglu.default, autopar.geglu.default)
def gated_rule(ctx: OpCtx) -> list[AxisOption]:
    return shard_every_dim(ctx)


@register(autopar.rope.default)
def rope_rule(ctx: OpCtx) -> list[AxisOption]:
    return shard_every_dim(ctx, skip=[-1])


@register(autopar.linear_cross_entropy.default)
def linear_cross_entropy_rule(ctx: OpCtx) -> list[AxisOption]:
    if ctx.n_in != 3 or not _partial_ok(ctx):
        return []
    reduction = ctx.arg(4, "reduction", "mean")
    opts = []
    if ctx.in_shapes[0][0] > 1:
        opts.append(AxisOption(R if reduction == "mean" else P, (Shard(0), R, Shard(0))))
    if ctx.in_shapes[1][0] > 1:
        opts.append(AxisOption(R, (R, Shard(0), R)))
    return opts
