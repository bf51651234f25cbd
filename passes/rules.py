"""Sharding rules, written once for ONE mesh axis and expanded to every axis by ``strategies.py``.

A rule maps an op (with its global input/output shapes) to the list of :class:`AxisOption`
it supports on one mesh axis of size n: the placement of its output and the placement each tensor
input must have. All-Replicate is always added by the expander, so rules list only the sharded
options. An op without a rule is replicated (and priced as such), never guessed.

Semantics (checked by tests against the dense op): running the op on local pieces, with inputs in
``ins``, yields the local piece of the output in ``out``:

* ``Shard(d)``: each rank holds the d-th dim cut into n equal contiguous blocks;
* ``Partial()``: each rank holds a summand; the full value is the sum over the axis;
* ``Replicate()``: each rank holds the full value.

A few ops need a rewritten local call (a *lowering*, in ``codegen/lower.py``): views and expands
get local sizes, ``mean`` over a sharded dim divides by n, and cross-entropy over a sharded batch
sums locally and all-reduces sum and count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

aten = torch.ops.aten
R, P = Replicate(), Partial()


@dataclass(frozen=True)
class AxisOption:
    """One way to run an op on one mesh axis."""

    out: Placement
    ins: tuple[Placement, ...]


@dataclass
class OpCtx:
    """What a rule may look at: the node, its args (tensors as fake values) and tensor shapes."""

    node: fx.Node
    args: tuple
    kwargs: dict
    in_shapes: list[tuple[int, ...]]
    out_shape: tuple[int, ...]

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        if len(self.args) > i:
            return self.args[i]
        return self.kwargs.get(name, default)

    @property
    def n_in(self) -> int:
        return len(self.in_shapes)


RuleFn = Callable[[OpCtx], list[AxisOption]]
RULES: dict[Any, RuleFn] = {}


def register(*ops) -> Callable[[RuleFn], RuleFn]:
    def deco(fn: RuleFn) -> RuleFn:
        for op in ops:
            RULES[op] = fn
        return fn

    return deco


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """Tensor-valued input nodes in flattened (args, kwargs) order: the order ``ins`` refers to."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [a for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def make_ctx(node: fx.Node) -> OpCtx:
    def to_val(a):
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    args = pytree.tree_map(to_val, node.args)
    kwargs = pytree.tree_map(to_val, node.kwargs)
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    out_shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
    return OpCtx(node, args, kwargs, [tuple(t.meta["val"].shape) for t in tensor_inputs(node)], out_shape)


def _norm(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


# --------------------------------------------------------------------------------------------------
# elementwise (with broadcasting) and shape-preserving ops
# --------------------------------------------------------------------------------------------------


def _partial_ok(ctx: OpCtx) -> bool:
    """Partial values are summed by all-reduce: only floating-point outputs may be Partial."""
    val = ctx.node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def broadcast_option(ctx: OpCtx, out_dim: int) -> AxisOption:
    """Shard output dim ``out_dim``; each input follows through broadcasting (size-1/missing -> R)."""
    ins = []
    nd = len(ctx.out_shape)
    for shape in ctx.in_shapes:
        j = out_dim - (nd - len(shape))
        ins.append(Shard(j) if j >= 0 and shape[j] == ctx.out_shape[out_dim] else R)
    return AxisOption(Shard(out_dim), tuple(ins))


def shard_every_dim(ctx: OpCtx, skip: Sequence[int] = ()) -> list[AxisOption]:
    nd = len(ctx.out_shape)
    skip = {_norm(d, nd) for d in skip}
    return [broadcast_option(ctx, d) for d in range(nd) if d not in skip and ctx.out_shape[d] > 1]


UNARY_LINEAR = [
    aten.neg.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
    aten.detach.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default,
    aten.lift_fresh_copy.default,
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


# --------------------------------------------------------------------------------------------------
# matmul family
# --------------------------------------------------------------------------------------------------


@register(aten.linear.default)
def linear_rule(ctx: OpCtx) -> list[AxisOption]:
    x, w = ctx.in_shapes[0], ctx.in_shapes[1]
    has_bias = ctx.n_in == 3
    b_r = (R,) if has_bias else ()
    opts = [AxisOption(Shard(d), (Shard(d), R) + b_r) for d in range(len(x) - 1) if x[d] > 1]  # batch-like
    opts.append(AxisOption(Shard(len(x) - 1), (R, Shard(0)) + ((Shard(0),) if has_bias else ())))  # column
    opts.append(AxisOption(P, (Shard(len(x) - 1), Shard(1)) + ((P,) if has_bias else ())))  # row
    opts.append(AxisOption(P, (P, R) + ((P,) if has_bias else ())))  # linear in x
    del w
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


# --------------------------------------------------------------------------------------------------
# embedding, norms, softmax, attention, loss
# --------------------------------------------------------------------------------------------------


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


@register(aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default)
def reduction_rule(ctx: OpCtx) -> list[AxisOption]:
    shape = ctx.in_shapes[0]
    nd = len(shape)
    dims = ctx.arg(1, "dim") if ctx.node.target in (aten.sum.dim_IntList, aten.mean.dim) else None
    keepdim = ctx.arg(2, "keepdim", False) if dims is not None else False
    reduced = set(range(nd)) if not dims else {_norm(d, nd) for d in dims}
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


# --------------------------------------------------------------------------------------------------
# views and data movement
# --------------------------------------------------------------------------------------------------


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
    u = _norm(ctx.arg(1, "dim"), len(src) + 1)
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
    a, b = _norm(ctx.arg(1, "dim0"), nd), _norm(ctx.arg(2, "dim1"), nd)
    perm = list(range(nd))
    perm[a], perm[b] = perm[b], perm[a]
    return _permute_options(ctx, perm)


@register(aten.permute.default)
def permute_rule(ctx: OpCtx) -> list[AxisOption]:
    nd = len(ctx.in_shapes[0])
    return _permute_options(ctx, [_norm(d, nd) for d in ctx.arg(1, "dims")])


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
    aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default
)
def slice_rule(ctx: OpCtx) -> list[AxisOption]:
    src = ctx.in_shapes[0]
    nd = len(src)
    splits = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
    dim = _norm(ctx.arg(2 if ctx.node.target in splits else 1, "dim", 0), nd)
    removes = ctx.node.target is aten.select.int
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
    dim = _norm(ctx.arg(1, "dim"), nd)
    return [
        AxisOption(Shard(d), (Shard(d), Shard(d)))
        for d in range(nd)
        if d != dim and src[d] == index[d] and src[d] > 1
    ]


@register(aten.argmax.default, aten.argmin.default, aten.max.dim, aten.min.dim)
def arg_reduction_rule(ctx: OpCtx) -> list[AxisOption]:
    src = ctx.in_shapes[0]
    nd = len(src)
    dim = ctx.arg(1, "dim")
    if dim is None:
        return []  # over all elements: replicated
    dim = _norm(dim, nd)
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
    dim = _norm(ctx.arg(2, "dim", -1), nd)
    return [
        AxisOption(Shard(d), (Shard(d),) * ctx.n_in)
        for d in range(nd)
        if d != dim and ctx.out_shape[d] > 1 and all(s[d] == ctx.out_shape[d] for s in ctx.in_shapes)
    ]


@register(aten.index.Tensor)
def index_rule(ctx: OpCtx) -> list[AxisOption]:
    # x[i0, i1, ..., ik-1] with index tensors on the k leading dims: out = broadcast(i) + x.shape[k:]
    indices = ctx.arg(1, "indices")
    k = len(indices)
    if any(i is None for i in indices) or k == 0:
        return []  # index tensors after a slice (None): replicated
    src, idx_shapes = ctx.in_shapes[0], ctx.in_shapes[1:]
    nb = len(ctx.out_shape) - (len(src) - k)
    opts = []
    for j in range(nb):  # a broadcast dim of the indices: gather locally from the full source
        if ctx.out_shape[j] > 1:
            ins = [R] + [
                Shard(j - (nb - len(s))) if j - (nb - len(s)) >= 0 and s[j - (nb - len(s))] > 1 else R
                for s in idx_shapes
            ]
            opts.append(AxisOption(Shard(j), tuple(ins)))
    for d in range(k, len(src)):  # a dim the indices do not touch
        if src[d] > 1:
            opts.append(AxisOption(Shard(nb + d - k), (Shard(d),) + (R,) * len(idx_shapes)))
    return opts


@register(aten.zeros.default, aten.ones.default, aten.full.default, aten.arange.default, aten.arange.start,
          aten.arange.start_step)  # fmt: skip
def factory_rule(ctx: OpCtx) -> list[AxisOption]:
    # no tensor input: each rank makes its own piece (codegen gives local sizes / a shifted range)
    if ctx.n_in:
        return []
    return [AxisOption(Shard(d), ()) for d in range(len(ctx.out_shape)) if ctx.out_shape[d] > 1]


@register(aten.new_zeros.default, aten.new_ones.default, aten.new_full.default)
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
    dim = _norm(ctx.arg(1, "dim", 0), nd)
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


# ops whose (single) output is a view of their first input
VIEW_OPS = frozenset(
    [
        aten.view.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
        aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
        aten.t.default, aten.alias.default, aten.slice.Tensor, aten.select.int, aten.as_strided.default,
    ]
)  # fmt: skip
# ops that allocate no new storage: views, plus the multi-output views and detach
ALIASING_OPS = VIEW_OPS | {
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
    aten.detach.default,
}


def has_rule(target) -> bool:
    return target in RULES
