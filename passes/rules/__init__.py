"""Sharding rules, written once for ONE mesh axis and expanded to every axis by ``strategies.py``.

A rule maps an op (with its global input/output shapes) to the list of :class:`AxisOption`
it supports on one mesh axis of size n: the placement of its output and the placement each tensor
input must have. All-Replicate is always added by the expander, so rules list only the sharded
options. An op without a rule here takes the options derived from PyTorch's DTensor strategies
(``dtensor.py``); an op with neither is replicated (and priced as such), never guessed.

Semantics (checked by ``autopar/tools/validate.py`` and its property tests against the dense op): running
the op on local pieces, with inputs in ``ins``, yields the local piece of the output in ``out``:

* ``Shard(d)``: each rank holds the d-th dim cut into n equal contiguous blocks;
* ``Partial()``: each rank holds a summand; the full value is the sum over the axis;
* ``Replicate()``: each rank holds the full value.

A few ops need a rewritten local call (a *lowering*, in ``codegen/lower.py``): views, expands and
factories get local sizes, ``mean`` over a sharded dim divides by n, a batch-sharded cross-entropy
all-reduces sum and count, a row-sharded embedding table looks up masked ids, causal attention on
a block of query rows gets a mask from global positions.

This module holds the registry and the helpers; the rules live by family in ``elementwise``,
``matmul``, ``nn`` (embedding, norms, softmax, attention, loss, reductions) and ``shape`` (views,
data movement, indexing, factories), imported at the end so that they register.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from autopar.placement import Via

aten = torch.ops.aten
R, P = Replicate(), Partial()


@dataclass(frozen=True)
class AxisOption:
    """One way to run an op on one mesh axis. ``via``: the algorithm where placements alone do not
    say it (attention on a sequence split: ``SeqAttention``); ``splits``: the (tensor input, dim)
    pairs the algorithm itself cuts into as many pieces as the axis has ranks (Ulysses' heads),
    which must then divide evenly like a Shard's dim."""

    out: Placement
    ins: tuple[Placement, ...]
    via: Via | None = None
    splits: tuple[tuple[int, int], ...] = ()


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


def _is_tensor_node(a) -> bool:
    return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def writes_inputs(node: fx.Node) -> bool:
    """Does ``node`` write to some of its inputs (an in-place or ``out=`` op, by its schema)?"""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def written_inputs(node: fx.Node) -> list[fx.Node]:
    """The positional inputs ``node`` writes into, by its schema's alias annotations (``self`` of
    an in-place op such as ``copy_``)."""
    if not writes_inputs(node):
        return []
    return [
        a
        for a, formal in zip(node.args, node.target._schema.arguments)
        if isinstance(a, fx.Node) and formal.alias_info is not None and formal.alias_info.is_write
    ]


def functional_twin(op) -> Any:
    """The out-of-place overload of an in-place op that writes only into ``self`` and returns it
    (``aten.div_.Tensor`` -> ``aten.div.Tensor``), or None."""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.name.endswith("_") or not schema.returns or not schema.arguments:
        return None
    written = [f for f in schema.arguments if f.alias_info is not None and f.alias_info.is_write]
    ret = schema.returns[0].alias_info
    if len(schema.returns) != 1 or written != [schema.arguments[0]] or ret is None or not ret.is_write:
        return None
    namespace, name = schema.name.split("::")
    packet = getattr(getattr(torch.ops, namespace), name[:-1], None)
    return getattr(packet, op._overloadname, None) if packet is not None else None


def in_place_options(ctx: OpCtx) -> list[AxisOption] | None:
    """An in-place op's options, where its out-of-place twin (``functional_twin``) has a rule: the
    twin's options that take ``self`` (the written input, the first tensor input) in the placement
    of the output, so that the write lands in the value the op returns; None without such a rule."""
    twin = functional_twin(ctx.node.target)
    rule = RULES.get(twin) if twin is not None else None
    first = ctx.node.args[0] if ctx.node.args else None
    if rule is None or not _is_tensor_node(first):
        return None
    return [o for o in rule(ctx) if o.ins and o.ins[0] == o.out]


def storage_base(node: fx.Node) -> fx.Node:
    """The node that allocated the storage ``node`` is: followed back through every op whose
    result aliases its first argument (views, and in-place ops, which return their ``self``)."""
    while True:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        first = node.args[0] if node.args else None
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            return node
        if not isinstance(first, fx.Node):
            return node
        node = first


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """Tensor-valued input nodes in flattened (args, kwargs) order: the order ``ins`` refers to.
    Cached on the node while its ``args`` and ``kwargs`` are the same objects (fx replaces them,
    never mutates them, when a node is rewired): the search asks for every node's once per mesh."""
    hit = node.meta.get(_TENSOR_INPUTS)
    if hit is not None and hit[0] is node.args and hit[1] is node.kwargs:
        return list(hit[2])
    found = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if _is_tensor_node(a)]
    node.meta[_TENSOR_INPUTS] = (node.args, node.kwargs, tuple(found))
    return found


_TENSOR_INPUTS = "autopar_tensor_inputs"


def map_args(
    node: fx.Node,
    tensor: Callable[[int, fx.Node], Any],
    other_node: Callable[[fx.Node], Any],
    value: Callable[[Any], Any] = lambda v: v,
    call: tuple[tuple, dict] | None = None,
) -> tuple[tuple, dict]:
    """``node``'s (args, kwargs) (or ``call``, other arguments of the same form) with its k-th
    tensor input (``tensor_inputs`` order) replaced by ``tensor(k, input)``, any other node by
    ``other_node(it)`` and every other leaf by ``value(it)``."""
    leaves, tree = pytree.tree_flatten((node.args, node.kwargs) if call is None else call)
    out, k = [], 0
    for leaf in leaves:
        if _is_tensor_node(leaf):
            out.append(tensor(k, leaf))
            k += 1
        elif isinstance(leaf, fx.Node):
            out.append(other_node(leaf))
        else:
            out.append(value(leaf))
    return pytree.tree_unflatten(out, tree)


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


def norm_dim(d: int, ndim: int) -> int:
    """Tensor dim ``d`` (negative counts from the end) as an index into ``ndim`` dims."""
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
    for in_shape in ctx.in_shapes:
        j = out_dim - (nd - len(in_shape))
        ins.append(Shard(j) if j >= 0 and in_shape[j] == ctx.out_shape[out_dim] else R)
    return AxisOption(Shard(out_dim), tuple(ins))


def shard_every_dim(ctx: OpCtx, skip: Sequence[int] = ()) -> list[AxisOption]:
    nd = len(ctx.out_shape)
    skip = {norm_dim(d, nd) for d in skip}
    return [broadcast_option(ctx, d) for d in range(nd) if d not in skip and ctx.out_shape[d] > 1]


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
    aten.unbind.int,
    aten.detach.default,
}


def has_rule(target) -> bool:
    return target in RULES


# the families register their rules on import
from autopar.passes.rules import elementwise, experts, fused, matmul, nn, shape  # noqa: E402, F401
