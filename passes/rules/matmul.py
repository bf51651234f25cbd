"""The matmul family (linear, addmm, mm, bmm, matmul, einsum) and convolutions: batch-like dims,
columns / output features, and contractions that leave a Partial sum."""

from __future__ import annotations

from torch.distributed.tensor.placement_types import Shard

from autopar.passes.rules import (
    AxisOption,
    OpCtx,
    P,
    R,
    _partial_ok,
    aten,
    register,
)
from autopar.placement import Matmul2D, Matmul3D

# matmul family


def linear_2d_options(ctx: OpCtx, via: Matmul2D) -> list[tuple[AxisOption, AxisOption]]:
    """The 2D layouts of a linear run by ``via`` (``autopar/lowerings/matmul_nd.py``), one per
    batch-like dim of its input taken as the rows: (the option of the axis that splits the rows and
    the weight's ``K``, the option of the axis that splits ``K`` of the input and the weight's
    ``N``). Neither is a one-axis option alone: ``passes/strategies.py`` places the pair on two axes
    of one size."""
    x = ctx.in_shapes[0]
    if len(x) < 2 or len(ctx.in_shapes[1]) != 2:
        return []
    has_bias = ctx.n_in == 3
    k = len(x) - 1
    cols = AxisOption(Shard(k), (Shard(k), Shard(0)) + ((Shard(0),) if has_bias else ()), via)
    return [
        (AxisOption(Shard(d), (Shard(d), Shard(1)) + ((R,) if has_bias else ()), via), cols)
        for d in range(k)
        if x[d] > 1
    ]


def mm_2d_options(ctx: OpCtx, via: Matmul2D) -> list[tuple[AxisOption, AxisOption]]:
    """``mm``'s 2D layout (``linear_2d_options``): ``[M, K] @ [K, N]``."""
    rows = AxisOption(Shard(0), (Shard(0), Shard(0)), via)
    return [(rows, AxisOption(Shard(1), (Shard(1), Shard(1)), via))]


def addmm_2d_options(ctx: OpCtx, via: Matmul2D) -> list[tuple[AxisOption, AxisOption]]:
    """``addmm``'s 2D layout (``linear_2d_options``): ``bias + [M, K] @ [K, N]``, the bias split
    like the output where it has the dim (it broadcasts where it does not)."""
    bias = ctx.in_shapes[0]
    b_m = Shard(0) if len(bias) == 2 and bias[0] > 1 else R
    b_n = Shard(len(bias) - 1) if bias and bias[-1] > 1 else R
    rows = AxisOption(Shard(0), (b_m, Shard(0), Shard(0)), via)
    return [(rows, AxisOption(Shard(1), (b_n, Shard(1), Shard(1)), via))]


# op -> its 2D layouts
GRID_OPTIONS = {
    aten.linear.default: linear_2d_options,
    aten.mm.default: mm_2d_options,
    aten.addmm.default: addmm_2d_options,
}


def linear_3d_options(ctx: OpCtx, via: Matmul3D) -> list[tuple[AxisOption, AxisOption]]:
    """The 3D layouts of a linear (``autopar/lowerings/matmul_nd.py``, Colossal-AI's ``_Linear3D``
    on one depth slice), one per batch-like dim ``d`` of its input: (the option of the axis over
    which ``X``'s ``d`` blocks are gathered, which splits the weight's and the output's ``N``;
    the option of the axis that splits ``K`` of ``X`` and ``W``, over which the output's partial
    sums are reduce-scattered onto ``d``). Neither is a one-axis option alone."""
    x = ctx.in_shapes[0]
    if len(x) < 2 or len(ctx.in_shapes[1]) != 2:
        return []
    has_bias = ctx.n_in == 3
    k = len(x) - 1
    return [
        (
            AxisOption(Shard(k), (Shard(d), Shard(0)) + ((Shard(0),) if has_bias else ()), via),
            AxisOption(Shard(d), (Shard(k), Shard(1)) + ((R,) if has_bias else ()), via),
        )
        for d in range(k)
        if x[d] > 1
    ]


def mm_3d_options(ctx: OpCtx, via: Matmul3D) -> list[tuple[AxisOption, AxisOption]]:
    """``mm``'s 3D layout (``linear_3d_options``): ``[M, K] @ [K, N]``, ``M`` gathered on the
    first axis, ``K`` split on the second."""
    gather = AxisOption(Shard(1), (Shard(0), Shard(1)), via)
    return [(gather, AxisOption(Shard(0), (Shard(1), Shard(0)), via))]


def addmm_3d_options(ctx: OpCtx, via: Matmul3D) -> list[tuple[AxisOption, AxisOption]]:
    """``addmm``'s 3D layout (``linear_3d_options``): ``bias + [M, K] @ [K, N]``, the bias split
    like the output where it has the dim (``N`` on the first axis, ``M`` on the second)."""
    bias = ctx.in_shapes[0]
    b_m = Shard(0) if len(bias) == 2 and bias[0] > 1 else R
    b_n = Shard(len(bias) - 1) if bias and bias[-1] > 1 else R
    gather = AxisOption(Shard(1), (b_n, Shard(0), Shard(1)), via)
    return [(gather, AxisOption(Shard(0), (b_m, Shard(1), Shard(0)), via))]


# op -> its 3D layouts
GRID_3D_OPTIONS = {
    aten.linear.default: linear_3d_options,
    aten.mm.default: mm_3d_options,
    aten.addmm.default: addmm_3d_options,
}


@register(aten.linear.default)
def linear_rule(ctx: OpCtx) -> list[AxisOption]:
    x = ctx.in_shapes[0]
    has_bias = ctx.n_in == 3
    b_r = (R,) if has_bias else ()
    opts = [AxisOption(Shard(d), (Shard(d), R) + b_r) for d in range(len(x) - 1) if x[d] > 1]  # batch-like
    opts.append(AxisOption(Shard(len(x) - 1), (R, Shard(0)) + ((Shard(0),) if has_bias else ())))  # column
    opts.append(AxisOption(P, (Shard(len(x) - 1), Shard(1)) + ((P,) if has_bias else ())))  # row
    opts.append(AxisOption(P, (P, R) + ((P,) if has_bias else ())))  # linear in x
    return opts


@register(aten.mm.default)
def mm_rule(ctx: OpCtx) -> list[AxisOption]:
    return [
        AxisOption(Shard(0), (Shard(0), R)),
        AxisOption(Shard(1), (R, Shard(1))),
        AxisOption(P, (Shard(1), Shard(0))),
        AxisOption(P, (P, R)),
        AxisOption(P, (R, P)),
    ]


@register(aten.addmm.default)
def addmm_rule(ctx: OpCtx) -> list[AxisOption]:
    bias = ctx.in_shapes[0]
    # bias broadcasts against [M, N]: a 1-D bias follows N only
    b_m = Shard(0) if len(bias) == 2 and bias[0] > 1 else R
    b_n = Shard(len(bias) - 1) if bias and bias[-1] > 1 else R
    return [
        AxisOption(Shard(0), (b_m, Shard(0), R)),
        AxisOption(Shard(1), (b_n, R, Shard(1))),
        AxisOption(P, (P, Shard(1), Shard(0))),
        AxisOption(P, (P, P, R)),
    ]


@register(aten.bmm.default)
def bmm_rule(ctx: OpCtx) -> list[AxisOption]:
    return [
        AxisOption(Shard(0), (Shard(0), Shard(0))),
        AxisOption(Shard(1), (Shard(1), R)),
        AxisOption(Shard(2), (R, Shard(2))),
        AxisOption(P, (Shard(2), Shard(1))),
        AxisOption(P, (P, R)),
        AxisOption(P, (R, P)),
    ]


@register(aten.matmul.default)
def matmul_rule(ctx: OpCtx) -> list[AxisOption]:
    a, b = ctx.in_shapes
    if len(a) < 2 or len(b) < 2:
        return []  # vector cases: replicated
    nd = len(ctx.out_shape)
    opts = []
    for d in range(nd - 2):  # broadcast batch dims
        pa, pb = d - (nd - len(a)), d - (nd - len(b))
        ia = Shard(pa) if pa >= 0 and a[pa] == ctx.out_shape[d] else R
        ib = Shard(pb) if pb >= 0 and b[pb] == ctx.out_shape[d] else R
        if ctx.out_shape[d] > 1:
            opts.append(AxisOption(Shard(d), (ia, ib)))
    opts += [
        AxisOption(Shard(nd - 2), (Shard(len(a) - 2), R)),  # rows of a
        AxisOption(Shard(nd - 1), (R, Shard(len(b) - 1))),  # columns of b
        AxisOption(P, (Shard(len(a) - 1), Shard(len(b) - 2))),  # contraction
    ]
    if _partial_ok(ctx):
        opts += [AxisOption(P, (P, R)), AxisOption(P, (R, P))]
    return opts


@register(aten.einsum.default)
def einsum_rule(ctx: OpCtx) -> list[AxisOption]:
    eq = ctx.arg(0, "equation").replace(" ", "")
    if "..." in eq or "->" not in eq:
        return []
    lhs, out = eq.split("->")
    terms = lhs.split(",")
    if len(terms) != ctx.n_in:
        return []
    sizes: dict[str, set] = {}
    for term, shape in zip(terms, ctx.in_shapes):
        for c, n in zip(term, shape):
            sizes.setdefault(c, set()).add(n)
    opts = []
    for c, ns in sizes.items():
        if len(ns) != 1 or next(iter(ns)) <= 1:
            continue  # broadcast (size-1) letters stay replicated
        ins = tuple(Shard(t.index(c)) if c in t else R for t in terms)
        opts.append(AxisOption(Shard(out.index(c)) if c in out else P, ins))  # summed letters give Partial
    if _partial_ok(ctx):  # multilinear: one Partial operand, the others replicated
        for i in range(ctx.n_in):
            opts.append(AxisOption(P, tuple(P if j == i else R for j in range(ctx.n_in))))
    return opts


@register(aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)
def conv_rule(ctx: OpCtx) -> list[AxisOption]:
    x, w = ctx.in_shapes[0], ctx.in_shapes[1]
    if len(x) != len(w) or isinstance(ctx.arg(4, "padding", 0), str):  # unbatched input or "same"/"valid"
        return []
    has_bias = ctx.n_in == 3
    groups = ctx.arg(6, "groups", 1)
    b = (R,) if has_bias else ()
    opts = [AxisOption(Shard(0), (Shard(0), R) + b)]  # batch
    if groups == 1:
        opts.append(AxisOption(Shard(1), (R, Shard(0)) + ((Shard(0),) if has_bias else ())))  # out channels
        opts.append(AxisOption(P, (Shard(1), Shard(1)) + ((P,) if has_bias else ())))  # in channels
    opts.append(AxisOption(P, (P, R) + ((P,) if has_bias else ())))  # linear in x
    return opts
