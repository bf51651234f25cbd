"""Views and data movement: reshapes tracked through dim groups, transposes, expands, slices,
splits, cat, gather and advanced indexing, pads, and factory ops made as local pieces."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
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

# views and data movement


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Split a reshape into groups of (src dims, dst dims) with equal products, ignoring size-1 dims."""
    s = [i for i, x in enumerate(src) if x != 1]
    d = [i for i, x in enumerate(dst) if x != 1]
    groups, i, j = [], 0, 0
    while i < len(s) and j < len(d):
        gs, gd = [s[i]], [d[j]]
        ps, pd = src[s[i]], dst[d[j]]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                ps *= src[s[i]]
                gs.append(s[i])
                i += 1
            else:
                pd *= dst[d[j]]
                gd.append(d[j])
                j += 1
        groups.append((gs, gd))
    return groups


@register(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def view_rule(ctx: OpCtx) -> list[AxisOption]:
    src, dst = ctx.in_shapes[0], ctx.out_shape
    # the leading dim of a group maps to the leading dim of its image: contiguous blocks stay contiguous
    opts = [AxisOption(Shard(gd[0]), (Shard(gs[0]),)) for gs, gd in view_groups(src, dst)]
    if ctx.node.meta["val"].dtype.is_floating_point:
        opts.append(AxisOption(P, (P,)))
    return opts


@register(aten.unsqueeze.default)
def unsqueeze_rule(ctx: OpCtx) -> list[AxisOption]:
    src = ctx.in_shapes[0]
    u = norm_dim(ctx.arg(1, "dim"), len(src) + 1)
    opts = [AxisOption(Shard(d + (d >= u)), (Shard(d),)) for d in range(len(src)) if src[d] > 1]
    return opts + ([AxisOption(P, (P,))] if _partial_ok(ctx) else [])


@register(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze_rule(ctx: OpCtx) -> list[AxisOption]:
    return [
        AxisOption(Shard(gd[0]), (Shard(gs[0]),)) for gs, gd in view_groups(ctx.in_shapes[0], ctx.out_shape)
    ]


@register(aten.transpose.int)
def transpose_rule(ctx: OpCtx) -> list[AxisOption]:
    nd = len(ctx.in_shapes[0])
    a, b = norm_dim(ctx.arg(1, "dim0"), nd), norm_dim(ctx.arg(2, "dim1"), nd)
    perm = list(range(nd))
    perm[a], perm[b] = perm[b], perm[a]
    return _permute_options(ctx, perm)


@register(aten.permute.default)
def permute_rule(ctx: OpCtx) -> list[AxisOption]:
    nd = len(ctx.in_shapes[0])
    return _permute_options(ctx, [norm_dim(d, nd) for d in ctx.arg(1, "dims")])


@register(aten.t.default)
def t_rule(ctx: OpCtx) -> list[AxisOption]:
    return _permute_options(ctx, list(reversed(range(len(ctx.in_shapes[0])))))


def _permute_options(ctx: OpCtx, perm: list[int]) -> list[AxisOption]:
    # output dim i is input dim perm[i]
    opts = [AxisOption(Shard(i), (Shard(p),)) for i, p in enumerate(perm) if ctx.out_shape[i] > 1]
    return opts + ([AxisOption(P, (P,))] if _partial_ok(ctx) else [])


@register(aten.expand.default)
def expand_rule(ctx: OpCtx) -> list[AxisOption]:
    src, dst = ctx.in_shapes[0], ctx.out_shape
    off = len(dst) - len(src)
    opts = [
        AxisOption(Shard(d + off), (Shard(d),))
        for d in range(len(src))
        if src[d] == dst[d + off] and src[d] > 1
    ]
    return opts + ([AxisOption(P, (P,))] if _partial_ok(ctx) else [])


@register(
    aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
    aten.unbind.int,
)  # fmt: skip
def slice_rule(ctx: OpCtx) -> list[AxisOption]:
    src = ctx.in_shapes[0]
    nd = len(src)
    splits = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
    dim = norm_dim(ctx.arg(2 if ctx.node.target in splits else 1, "dim", 0), nd)
    removes = ctx.node.target in (aten.select.int, aten.unbind.int)
    opts = []
    for d in range(nd):
        if d == dim or src[d] <= 1:
            continue
        opts.append(AxisOption(Shard(d - (removes and d > dim)), (Shard(d),)))
    return opts + ([AxisOption(P, (P,))] if _partial_ok(ctx) else [])


@register(aten.gather.default)
def gather_rule(ctx: OpCtx) -> list[AxisOption]:
    src, index = ctx.in_shapes
    nd = len(src)
    dim = norm_dim(ctx.arg(1, "dim"), nd)
    return [
        AxisOption(Shard(d), (Shard(d), Shard(d)))
        for d in range(nd)
        if d != dim and src[d] == index[d] and src[d] > 1
    ]


@register(aten.scatter.value, aten.scatter.src)
def scatter_rule(ctx: OpCtx) -> list[AxisOption]:
    """``scatter(self, dim, index, value | src)`` writes along ``dim`` within each slice of the other
    dims: split any other dim that ``index`` (and ``src``) cover whole, every tensor on its rows.
    ``scatter_``, its in-place twin, takes these with ``self`` placed as the output
    (``rules.in_place_options``): DeepSeek-V3's router marks its chosen groups so."""
    out = ctx.in_shapes[0]
    nd = len(out)
    dim = norm_dim(ctx.arg(1, "dim"), nd)
    return [
        AxisOption(Shard(d), (Shard(d),) * ctx.n_in)
        for d in range(nd)
        if d != dim and out[d] > 1 and all(len(s) == nd and s[d] == out[d] for s in ctx.in_shapes)
    ]


@register(aten.argmax.default, aten.argmin.default, aten.max.dim, aten.min.dim)
def arg_reduction_rule(ctx: OpCtx) -> list[AxisOption]:
    src = ctx.in_shapes[0]
    nd = len(src)
    dim = ctx.arg(1, "dim")
    if dim is None:
        return []  # over all elements: replicated
    dim = norm_dim(dim, nd)
    keepdim = ctx.arg(2, "keepdim", False)
    return [
        AxisOption(Shard(d if keepdim or d < dim else d - 1), (Shard(d),))
        for d in range(nd)
        if d != dim and src[d] > 1
    ]


@register(aten.cumsum.default, aten.cumprod.default)
def scan_rule(ctx: OpCtx) -> list[AxisOption]:
    return shard_every_dim(ctx, skip=[ctx.arg(1, "dim")])


@register(aten.diff.default)
def diff_rule(ctx: OpCtx) -> list[AxisOption]:
    # diff(x, n, dim, prepend, append): prepend/append follow x on every other dim
    nd = len(ctx.in_shapes[0])
    dim = norm_dim(ctx.arg(2, "dim", -1), nd)
    return [
        AxisOption(Shard(d), (Shard(d),) * ctx.n_in)
        for d in range(nd)
        if d != dim and ctx.out_shape[d] > 1 and all(s[d] == ctx.out_shape[d] for s in ctx.in_shapes)
    ]


@register(aten.index.Tensor)
def index_rule(ctx: OpCtx) -> list[AxisOption]:
    """``x[..., i, j, ...]``: index tensors at some dims of ``x`` (None: the dim whole, as ``:``).
    The indices broadcast to one shape ``b``; adjacent index tensors put ``b`` where the first one
    was, separated ones put it first; every dim of ``x`` no index touches follows, in order.

    Options: a dim of ``x`` no index touches, split alike in ``x`` and the output (indices whole);
    a dim of ``b``, split in the indices that have it (the others whole) with ``x`` whole (each rank
    gathers its rows); and, where an index is the identity over an indexed dim of ``x`` (an
    ``arange`` of that dim's length, e.g. ``logits[arange(B), last]``), that dim split in ``x`` and
    in the index alike: each rank's rows index only its own rows of ``x`` (the lowering makes the
    index local). The last is what keeps a batch split through per-sample indexing."""
    indices = ctx.arg(1, "indices")
    src = ctx.in_shapes[0]
    at = [p for p, i in enumerate(indices) if i is not None]
    if not at or len(indices) > len(src):
        return []
    idx_shapes = ctx.in_shapes[1:]
    nb = max(len(s) for s in idx_shapes)
    adjacent = at == list(range(at[0], at[-1] + 1))
    b0 = at[0] if adjacent else 0  # where the broadcast dims start in the output
    rest = [d for d in range(len(src)) if d not in at]
    out_of = {d: (o if o < b0 else o + nb) for o, d in enumerate(rest)}  # x dim -> output dim

    def idx_pl(j: int) -> list[Placement]:
        # each index tensor split on broadcast dim j where it has it (size > 1), whole elsewhere
        out = []
        for s in idx_shapes:
            k = j - (nb - len(s))
            out.append(Shard(k) if k >= 0 and s[k] > 1 else R)
        return out

    index_nodes = ctx.node.args[1] if len(ctx.node.args) > 1 else ctx.node.kwargs["indices"]
    opts = []
    for d in rest:
        if src[d] > 1:
            opts.append(AxisOption(Shard(out_of[d]), (Shard(d),) + (R,) * len(idx_shapes)))
    for j in range(nb):
        if ctx.out_shape[b0 + j] > 1:
            opts.append(AxisOption(Shard(b0 + j), (R, *idx_pl(j))))
    for p in at:
        j = _identity_index_dim(index_nodes[p], src[p], nb)
        if j is not None and src[p] > 1:
            opts.append(AxisOption(Shard(b0 + j), (Shard(p), *idx_pl(j))))
    return opts


# ops through which an ``arange`` stays an arange along one dim (its values unchanged)
_INDEX_PASS = frozenset(
    [
        aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
        aten.expand.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
        aten.alias.default, aten.clone.default,
    ]
)  # fmt: skip


def _identity_index_dim(node: Any, length: int, nb: int) -> int | None:
    """The broadcast dim (of ``nb``) along which index ``node`` runs 0, 1, ..., length - 1, where it
    is an ``arange(length)`` (start 0, step 1) seen through unsqueezes, views, expands and casts
    with that one dim of more than one element; None otherwise."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype.is_floating_point:
        return None
    big = [k for k, n in enumerate(val.shape) if n > 1]
    if len(big) != 1 or val.shape[big[0]] != length:
        return None
    src = node
    while src.op == "call_function" and src.target in _INDEX_PASS:
        src = src.args[0]
        if not isinstance(src, fx.Node):
            return None
    if src.op != "call_function" or src.target not in _ARANGES:
        return None
    if arange_range(src.target, src.args, src.kwargs) != (0, length, 1):
        return None
    return big[0] + (nb - len(val.shape))


_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)


def arange_range(target, args, kwargs) -> tuple[Any, Any, Any]:
    """(start, end, step) of an ``aten.arange`` overload's call, its defaults filled in: the rule
    above and codegen's lowering of a split arange (``codegen/lower.py``) read it alike."""
    names = {aten.arange.default: ["end"], aten.arange.start: ["start", "end"]}.get(
        target, ["start", "end", "step"]
    )
    bound = {"start": 0, "step": 1, **dict(zip(names, args))}
    bound.update((k, kwargs[k]) for k in ("start", "end", "step") if k in kwargs)
    return bound["start"], bound.get("end"), bound["step"]


@register(aten.zeros.default, aten.ones.default, aten.full.default, aten.arange.default, aten.arange.start,
          aten.arange.start_step)  # fmt: skip
def factory_rule(ctx: OpCtx) -> list[AxisOption]:
    # no tensor input: each rank makes its own piece (codegen gives local sizes / a shifted range)
    if ctx.n_in:
        return []
    return [AxisOption(Shard(d), ()) for d in range(len(ctx.out_shape)) if ctx.out_shape[d] > 1]


@register(aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default)
def new_factory_rule(ctx: OpCtx) -> list[AxisOption]:
    # self gives only dtype and device: any placement of it will do, and the output may be made
    # directly as a local piece (codegen gives the local size)
    src = ctx.in_shapes[0]
    ins = [R] + [Shard(d) for d in range(len(src)) if src[d] > 1] + ([P] if _partial_ok(ctx) else [])
    outs = [R] + [Shard(d) for d in range(len(ctx.out_shape)) if ctx.out_shape[d] > 1]
    return [AxisOption(o, (i,)) for o in outs for i in ins]


@register(aten.cat.default)
def cat_rule(ctx: OpCtx) -> list[AxisOption]:
    nd = len(ctx.out_shape)
    dim = norm_dim(ctx.arg(1, "dim", 0), nd)
    if any(len(s) != nd for s in ctx.in_shapes):  # legacy empty-tensor cat: keep replicated
        return []
    opts = [
        AxisOption(Shard(d), (Shard(d),) * ctx.n_in)
        for d in range(nd)
        if d != dim and ctx.out_shape[d] > 1 and all(s[d] == ctx.out_shape[d] for s in ctx.in_shapes)
    ]
    return opts + ([AxisOption(P, (P,) * ctx.n_in)] if _partial_ok(ctx) else [])


@register(aten.flatten.using_ints)
def flatten_rule(ctx: OpCtx) -> list[AxisOption]:
    # a reshape that needs no local sizes: the local flatten of local pieces is the local piece
    return view_rule(ctx)


@register(aten.pad.default, aten.constant_pad_nd.default)
def pad_rule(ctx: OpCtx) -> list[AxisOption]:
    src = ctx.in_shapes[0]
    nd = len(src)
    pad = list(ctx.arg(1, "pad"))
    padded = {nd - 1 - i // 2 for i in range(len(pad)) if pad[i] != 0}  # pairs from the last dim backwards
    # every mode pads a dim from values along that dim only: the other dims may be cut
    opts = [AxisOption(Shard(d), (Shard(d),)) for d in range(nd) if d not in padded and src[d] > 1]
    if ctx.node.target is aten.pad.default:
        mode, value = ctx.arg(2, "mode", "constant"), ctx.arg(3, "value", None)
    else:
        mode, value = "constant", ctx.arg(2, "value", 0)
    if mode == "constant" and not value and ctx.node.meta["val"].dtype.is_floating_point:
        opts.append(AxisOption(P, (P,)))  # zero padding is linear
    return opts
