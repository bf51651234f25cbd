"""Causal masks: an attention mask built from shapes alone that is the causal one becomes ``is_causal``.

Traced, Hugging Face models do not take their eager shortcut (``is_causal=True``, no mask): their
mask code materializes the causal mask from ``arange`` comparisons and ``expand`` (a
``(batch, 1, L, S)`` boolean), so the graph calls

    scaled_dot_product_attention(q, k, v, mask)

which keeps SDPA off the flash kernel, and costs the mask's memory and ops. This pass rewrites such
a call into ``scaled_dot_product_attention(q, k, v, is_causal=True)`` (every other argument as it
was) when it can *prove* the mask is the causal one:

1. the mask is a function of shapes alone: no ancestor of it is a placeholder (a user input such as
   ``attention_mask``, a parameter, a buffer), a ``get_attr`` or a random op, so its value is the
   same at every call;
2. its value, computed for real on the CPU (an ``fx.Interpreter`` over the mask's ancestors only,
   every device argument retargeted to the CPU, the meta device of a model planned on meta
   included), equals SDPA's ``is_causal`` mask: ``C = ones(L, S, dtype=bool).tril()`` (top-left
   aligned, ``L`` = query rows, ``S`` = key rows) at every index, where a boolean mask attends
   where True (``mask == C``) and a float mask adds 0 where attended and ``-inf`` (or at most the
   dtype's lowest finite value) where masked.

Only one slice is compared per broadcast dimension: a leading dim of size 1 or of stride 0 (an
``expand``) holds one distinct slice, index 0; a leading dim that is really materialized (the batch
dim of Hugging Face's mask, built by indexing with ``arange(batch)``) is compared in full.

A mask too large to hold (a 128K-token sequence's is 16 GiB of booleans per batch row) is not
computed whole: an op that would take the evaluation past ``EVAL_BUDGET_BYTES`` (counted as the
evaluation allocates, op by op), and every op reading its result, is kept as its expression where
it is elementwise, a size-1 view or ``tril``/``triu``, and proven causal from that expression
(``passes/mask_blocks.py``): on its ``L + S - 1`` diagonals where it is shown to depend on ``j - i``
alone (``passes/mask_diagonals.py``), else element by element in blocks of query rows, each within
the budget. A constant fill too large to hold is one element, broadcast.

Anything else (a mask that fails to evaluate, a padding or sliding-window mask, a mask over the
budget read by an op that is not blockwise, a budget that cannot hold one block of rows) is left as
it is: never guessed.

Only the top-level graph is visited: an SDPA call inside a higher-order op's region (a
``torch.no_grad()`` or ``torch.autocast`` submodule) keeps its mask.

The mask nodes no other node uses any more are then erased (placeholders and output untouched), the
graph linted and recompiled. Every remaining node keeps its ``meta["val"]``: the SDPA output's
shape and dtype do not depend on the mask, so :class:`~autopar.passes.trace.TracedGraph`'s
invariants (placeholders, specs, state) hold as they were.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.passes.mask_blocks import (
    BITWISE_ALIASES,
    Lazy,
    NotBlockwise,
    causal_blockwise,
    constant_fill,
    lazy_call,
    matches_causal,
)
from autopar.passes.mask_diagonals import diagonal_vector

SDPA = torch.ops.aten.scaled_dot_product_attention.default
# SDPA's schema, in order (aten::scaled_dot_product_attention)
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# the most bytes the mask's evaluation may hold at once (its live values, as the interpreter frees
# each after its last use): a (8, 1, 8192, 8192) boolean mask is 512 MiB, and Hugging Face's mask
# code keeps about three such tensors alive
EVAL_BUDGET_BYTES = 4 * 2**30


def rewrite_causal_masks(gm: fx.GraphModule, recompile: bool = True) -> int:
    """Rewrite every SDPA call of ``gm``'s graph whose mask is proven causal (module docstring);
    return how many were rewritten. ``recompile=False``: the caller regenerates ``gm``'s code."""
    values: dict[fx.Node, torch.Tensor | Lazy | None] = {}  # one evaluation per mask (every layer shares it)
    verdicts: dict[tuple[fx.Node, tuple[int, int]], bool] = {}
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        call = _bind(node)
        mask = call.get("attn_mask")
        if not isinstance(mask, fx.Node) or call.get("is_causal", False):
            continue
        q, k = call["query"].meta.get("val"), call["key"].meta.get("val")
        if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
            continue
        shape = (q.shape[-2], k.shape[-2])
        if not all(isinstance(d, int) for d in shape):  # a dynamic size: no value to compare with
            continue
        if mask not in values:
            values[mask] = _evaluate(mask)
        key = (mask, shape)
        if key not in verdicts:
            verdicts[key] = is_causal_mask(values[mask], *shape)
        if not verdicts[key]:
            continue
        del call["attn_mask"]
        call["is_causal"] = True
        q, k, v = call.pop("query"), call.pop("key"), call.pop("value")
        node.args, node.kwargs = (q, k, v), call
        rewritten += 1
    if rewritten:
        _erase_dead(set(values))
        gm.graph.lint()
        if recompile:
            gm.recompile()
    return rewritten


def _bind(node: fx.Node) -> dict:
    """The call's arguments by name (positional ones named from the schema)."""
    call = dict(zip(SDPA_ARGS, node.args))
    call.update(node.kwargs)
    return call


def ancestors(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node it depends on, in graph order."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _shape_only(nodes: list[fx.Node]) -> bool:
    """Every node is an op call whose value depends on shapes alone (no input, state or randomness)."""
    for n in nodes:
        if n.op != "call_function" or not callable(n.target):
            return False
        if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()):
            return False
        if isinstance(n.target, torch._ops.HigherOrderOperator):  # a region: runs a submodule
            return False
    return True


def _live_peak(nodes: list[fx.Node]) -> int:
    """The most bytes of the nodes' values held at once when each is freed after its last use
    among ``nodes`` (what ``fx.Interpreter`` does); a value of unknown size counts as too large."""
    index = {n: i for i, n in enumerate(nodes)}
    last = {n: index[n] for n in nodes}
    for n in nodes:
        for a in n.all_input_nodes:
            last[a] = max(last[a], index[n])
    live, peak = 0, 0
    for i, n in enumerate(nodes):
        for v in pytree.tree_leaves(n.meta.get("val")):
            if isinstance(v, torch.Tensor):
                live += v.numel() * v.element_size()
            elif v is None or isinstance(v, (torch.SymInt, torch.SymFloat)):
                return EVAL_BUDGET_BYTES + 1
        peak = max(peak, live)
        for a in set(n.all_input_nodes):
            if last[a] == i:
                live -= sum(
                    t.numel() * t.element_size()
                    for t in pytree.tree_leaves(a.meta.get("val"))
                    if isinstance(t, torch.Tensor)
                )
    return peak


def _evaluate(mask: fx.Node) -> torch.Tensor | Lazy | None:
    """The mask's value computed on the CPU (a :class:`Lazy` expression where too large to hold),
    or None where it depends on more than shapes, would hold more than ``EVAL_BUDGET_BYTES`` even
    so, or fails to run."""
    nodes = ancestors(mask)
    if not _shape_only(nodes):
        return None
    cpu = torch.device("cpu")

    def on_cpu(a):
        return cpu if isinstance(a, torch.device) else a

    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        args, kwargs = pytree.tree_map(
            on_cpu, pytree.tree_map_only(fx.Node, env.__getitem__, (n.args, n.kwargs))
        )
        env[n] = g.call_function(n.target, tuple(args), dict(kwargs))
    g.output(env[mask])
    gm = fx.GraphModule(torch.nn.Module(), g)
    if all(_value_only(n.target) for n in nodes):
        try:
            with torch.no_grad():
                value = _Broadcasts(gm).run()
            return value if isinstance(value, (torch.Tensor, Lazy)) else None
        except _OverBudget:  # as written, it would hold more still
            return None
        except Exception:  # noqa: BLE001 - e.g. a view a broadcast cannot take: evaluated as written
            pass
    if _live_peak(nodes) > EVAL_BUDGET_BYTES:
        return None
    try:
        with torch.no_grad():
            value = fx.Interpreter(gm).run()
    except Exception:  # noqa: BLE001 - a mask that cannot be computed here is left as it is
        return None
    return value if isinstance(value, torch.Tensor) else None


# the bitwise operators torch does not tag pointwise (their ``bitwise_*`` ops are)
_POINTWISE_ALIASES = BITWISE_ALIASES
# broadcast slices are looked for in bool and integer values of at most this many elements (a
# full compare each, tens of ms at this size; float values are never merged: -0.0 equals 0.0).
# Hugging Face's per-row positions at 8,192 rows of 4,096 tokens (DeepSeek-V3 on 2,048 H100) are
# (8192, 1, 4096, 1), 2**25 elements: under a smaller cap they stayed whole, the mask past the
# budget became lazy and was proven one batch row at a time (4.2 s of CPU, 1.7 s with the cap)
SHARED_SLICE_MAX_ELEMENTS = 2**26


def _value_only(target) -> bool:
    """An op whose result depends on its inputs' values alone, never on their strides (no
    ``as_strided``, no mutation): a broadcast view may stand for an equal materialized input."""
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return not target._schema.is_mutable and "as_strided" not in target.name()


def _pointwise(target) -> bool:
    return target in _POINTWISE_ALIASES or torch.Tag.pointwise in getattr(target, "tags", ())


class _Broadcasts(fx.Interpreter):
    """Computes the mask's value keeping what repeats along a dim as a broadcast (stride 0): a
    pointwise op whose every input is broadcast along a dim runs on one slice of it, and a small
    integer or bool value whose slices along a dim are all equal becomes a broadcast of the first.
    Every element has the value the graph computes (a pointwise op's element depends only on its
    inputs' elements at the same index; the ops are ``_value_only``); a Hugging Face mask, built
    per batch row by indexing with ``arange(batch)``, then costs one row instead of ``batch``.

    Its memory is checked before each op runs, not from the values' shapes (a Hugging Face mask
    of 1024 rows is 16 GiB as written, a few MiB with its broadcasts kept): the op first runs on
    meta tensors of the same shapes and strides, which tells the storage its result allocates (none
    where it aliases an input, as ``expand`` or a ``to`` that changes nothing does); past
    ``EVAL_BUDGET_BYTES`` with what is held, ``_OverBudget`` is raised before anything is allocated."""

    def call_function(self, target, args, kwargs):
        if any(isinstance(a, Lazy) for a in pytree.tree_leaves((args, kwargs))):
            return self._lazy(target, args, kwargs)
        try:
            out = None
            if _pointwise(target):
                out = _on_one_slice(target, args, kwargs, self._within_budget)
            if out is None:
                self._within_budget(target, args, kwargs)
                out = target(*args, **kwargs)
        except _OverBudget:  # too large to hold: a constant, or kept as its expression
            out = constant_fill(target, args, kwargs)
            if out is None:
                return self._lazy(target, args, kwargs)
        return _shared_slices(out)

    def _lazy(self, target, args, kwargs) -> Lazy:
        """The op's result kept as its expression (``passes/mask_blocks.py``); ``_OverBudget``
        where it cannot be (the mask is then left as it is)."""
        try:
            return lazy_call(target, args, kwargs, _on_meta(target, args, kwargs))
        except NotBlockwise as e:
            raise _OverBudget(target) from e

    def _within_budget(self, target, args, kwargs) -> None:
        held = {}
        for v in pytree.tree_leaves(list(self.env.values())):
            for t in v.leaves() if isinstance(v, Lazy) else [v]:
                if isinstance(t, torch.Tensor):
                    held[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        if sum(held.values()) + _allocates(target, args, kwargs) > EVAL_BUDGET_BYTES:
            raise _OverBudget(target)


class _OverBudget(Exception):
    """The mask's evaluation would hold more than ``EVAL_BUDGET_BYTES``."""


def _meta_args(args, kwargs):
    """The arguments as meta tensors of the same shapes, strides and dtypes (a lazy value: its
    shape, contiguous), devices as the meta device."""

    def on_meta(a):
        if isinstance(a, Lazy):
            return torch.empty(a.shape, dtype=a.dtype, device="meta")
        if isinstance(a, torch.Tensor):
            return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        return torch.device("meta") if isinstance(a, torch.device) else a

    return pytree.tree_map(on_meta, (args, kwargs), is_leaf=lambda a: isinstance(a, Lazy))


def _on_meta(target, args, kwargs) -> torch.Tensor:
    """The op's single tensor result run on meta arguments; ``NotBlockwise`` where it has none."""
    margs, mkwargs = _meta_args(args, kwargs)
    try:
        out = target(*margs, **mkwargs)
    except Exception as e:  # noqa: BLE001 - not to be run blind
        raise NotBlockwise(f"{target} does not run on meta tensors") from e
    if not isinstance(out, torch.Tensor):
        raise NotBlockwise(f"{target} returns {type(out).__name__}")
    return out


def _allocates(target, args, kwargs) -> float:
    """Bytes of new storage ``target(*args, **kwargs)`` allocates, found by running it on meta
    tensors of the inputs' shapes, strides and dtypes (0 where its results alias an input); inf
    where that dry run fails (a result whose shape depends on values)."""
    margs, mkwargs = _meta_args(args, kwargs)
    try:
        out = target(*margs, **mkwargs)
    except Exception:  # noqa: BLE001 - not to be run blind
        return math.inf
    inputs = {
        t.untyped_storage()._cdata
        for t in pytree.tree_leaves((margs, mkwargs))
        if isinstance(t, torch.Tensor)
    }
    return sum(
        t.untyped_storage().nbytes()
        for t in pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs
    )


def _on_one_slice(target, args, kwargs, check: Callable = lambda *_: None):
    """``target(*args, **kwargs)`` of a pointwise op run on one slice of every dim where each input
    is broadcast, then broadcast back; None where no dim is. ``check(target, args, kwargs)`` is
    called on the call made, before it is."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    ts = [a for a in flat if isinstance(a, torch.Tensor) and a.dim() > 0]
    if not ts:
        return None
    shape = torch.broadcast_shapes(*(t.shape for t in ts))
    n = len(shape)

    def broadcast(t: torch.Tensor, d: int) -> bool:
        e = d - (n - t.dim())
        return e < 0 or t.shape[e] == 1 or t.stride(e) == 0

    dims = [d for d in range(n) if shape[d] > 1 and all(broadcast(t, d) for t in ts)]
    if not dims:
        return None

    def one_slice(a):
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            for d in dims:
                e = d - (n - a.dim())
                if e >= 0 and a.shape[e] > 1:
                    a = a.narrow(e, 0, 1)
        return a

    args, kwargs = pytree.tree_unflatten([one_slice(a) for a in flat], spec)
    check(target, args, kwargs)
    out = target(*args, **kwargs)
    if not isinstance(out, torch.Tensor) or out.dim() != n:
        return None
    return out.expand(shape)


def _shared_slices(value):
    """``value`` with every dim whose slices are all equal made a broadcast of its first slice
    (bool and integer tensors of at most ``SHARED_SLICE_MAX_ELEMENTS`` elements; others as they are)."""
    if (
        not isinstance(value, torch.Tensor)
        or value.dtype.is_floating_point
        or value.dtype.is_complex
        or value.numel() > SHARED_SLICE_MAX_ELEMENTS
    ):
        return value
    for d in range(value.dim()):
        if value.shape[d] > 1 and value.stride(d) != 0:
            first = value.narrow(d, 0, 1).expand(value.shape)
            if torch.equal(value, first):
                value = first
    return value


def is_causal_mask(mask: torch.Tensor | Lazy | None, rows: int, cols: int) -> bool:
    """Whether ``mask``, broadcast to ``(..., rows, cols)``, is SDPA's ``is_causal`` mask at every
    index (module docstring): True attends in a boolean mask; 0 attends and ``-inf`` (or at most the
    dtype's lowest finite value) masks in a float one. A :class:`Lazy` mask is compared in blocks
    of rows (``passes/mask_blocks.py``) within ``EVAL_BUDGET_BYTES``."""
    if isinstance(mask, Lazy):
        return causal_blockwise(mask, rows, cols, EVAL_BUDGET_BYTES, diagonal_vector)
    if mask is None or mask.dim() < 2 or not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
        return False
    try:
        m = mask.expand(*mask.shape[:-2], rows, cols)
    except RuntimeError:  # the last two dims do not broadcast to (rows, cols)
        return False
    # one slice of every broadcast leading dim; a materialized one is compared in full
    m = m[tuple(0 if m.shape[d] == 1 or m.stride(d) == 0 else slice(None) for d in range(m.dim() - 2))]
    return matches_causal(m, torch.ones(rows, cols, dtype=torch.bool).tril())


def _erase_dead(masks: set[fx.Node]) -> None:
    """Erase the masks' ancestors that nothing uses any more, users first (never a placeholder,
    the output, or an op with side effects)."""
    nodes = [n for n in masks if n.graph is not None]
    if not nodes:
        return
    graph = nodes[0].graph
    candidates = set().union(*(ancestors(m) for m in nodes))
    for n in reversed(list(graph.nodes)):
        if n in candidates and not n.users and n.op == "call_function" and not n.is_impure():
            graph.erase_node(n)
