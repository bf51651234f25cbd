"""Fuse: rewrite aten patterns of the traced graph into autopar's fused kernels (``kernels/``).

Matched on the aten graph, never on module names, so every family that computes the same
arithmetic is found (Llama, Mistral, Qwen and Gemma's RMSNorm; GPT-2, GPT-NeoX and the PaLM-style
model's residual + LayerNorm; every gated MLP; Hugging Face's rotary embedding wherever it is
applied). Each match becomes one ``call_function`` of a ``torch.ops.autopar`` custom op (plus
``getitem`` where it returns two values), inserted right after the last of its inputs, and the
replaced nodes are erased. The rewritten graph is then analyzed, sharded, priced and lowered like
any other: the fused op's bytes are its inputs and outputs moved once, what it keeps for backward
is what its autograd saves (``passes/analyze.py`` probes both), its sharding rules are in
``passes/rules/fused.py``.

A match is taken only where the fused op gives the replaced value's shape and dtype (its fake
implementation is run on the traced values) and every intermediate value it absorbs has no other
use, so nothing the rest of the graph reads disappears. Which kernels are fused is the plan's
choice (``SearchOptions.kernels``): every kernel on an accelerator (Triton runs there), none on a
CPU cluster unless asked (the torch fallbacks run there, for tests and for their memory).

Patterns (``a -> b``: ``b`` reads ``a``; ``?``: optional):

* RMS_NORM: ``[x = p + q]? -> to(float32)? -> pow(2) -> mean(-1, keepdim) -> add(eps) -> rsqrt
  -> mul(x, rsqrt) -> [to(dtype) | mul(w or 1 + w)]*`` (a cast and a weight, in either order)
* LAYER_NORM: ``x = p + q -> layer_norm(x, [N], w, b, eps)`` (``x`` may be used elsewhere too)
* SWIGLU / GEGLU: ``mul(silu(gate), up)`` / ``mul(gelu(gate), up)`` (either operand order)
* ROPE: ``add(mul(x, cos), mul(cat([neg(x[..., D/2:]), x[..., :D/2]], -1), sin))``
* LINEAR_CROSS_ENTROPY: ``linear(h, W) -> to(float32)? -> view(-1, V) -> cross_entropy_loss``
  (no class weight, no label smoothing, mean or sum), the logits read by nothing else
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from autopar.fusion import Kernel, KernelUse
from autopar.hardware import DeviceKind, per_kind
from autopar.kernels import ops as kernel_ops
from autopar.passes.trace import TracedGraph

aten = torch.ops.aten

_CAST = (aten.to.dtype, aten._to_copy.default)


def fuse(tg: TracedGraph, kernels: Collection[Kernel]) -> tuple[KernelUse, ...]:
    """Rewrite every match of ``kernels`` in ``tg``'s graph (in place); the substitutions made."""
    if not kernels:
        return ()
    kernel_ops.load()
    g = tg.graph
    used: list[KernelUse] = []
    for kernel in Kernel:  # a fixed order: a plan re-applied rewrites the same nodes the same way
        if kernel not in kernels:
            continue
        for node in list(g.nodes):
            if node.graph is not g or node.op != "call_function":
                continue  # erased by an earlier match
            match = _MATCHERS[kernel](node)
            if match is not None:
                use = _rewrite(g, kernel, match)
                if use is not None:
                    used.append(use)
    if used:
        tg.graph_module.recompile()
    return tuple(used)


# -- matching ---------------------------------------------------------------------------------------


class _Match:
    """What a matcher found: the op to call, its arguments (nodes or constants), the node whose
    value its output 0 replaces, the node (if any) output 1 replaces, and every node it absorbs."""

    def __init__(self, op, args: tuple, out: fx.Node, absorbed: list[fx.Node], second: fx.Node | None = None):
        self.op, self.args, self.out, self.absorbed, self.second = op, args, out, absorbed, second


def _is(n, *targets) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _tensor(n) -> bool:
    return isinstance(_val(n), torch.Tensor)


def _only_use(n: fx.Node, user: fx.Node) -> bool:
    return len(n.users) == 1 and user in n.users


def _float32_cast(n) -> bool:
    return _is(n, *_CAST) and _val(n).dtype == torch.float32 and _tensor(n.args[0])


def _residual(x: fx.Node):
    """``(p, q)`` where ``x = p + q`` of two tensors of ``x``'s shape and dtype, else None."""
    if not _is(x, aten.add.Tensor) or len(x.args) != 2 or x.kwargs:
        return None
    p, q = x.args
    if not (_tensor(p) and _tensor(q)):
        return None
    v = _val(x)
    if any(tuple(_val(t).shape) != tuple(v.shape) or _val(t).dtype != v.dtype for t in (p, q)):
        return None
    return p, q


def _match_rms_norm(r: fx.Node) -> _Match | None:
    if not _is(r, aten.rsqrt.default):
        return None
    a = r.args[0]
    if not _is(a, aten.add.Tensor) or not _only_use(a, r):
        return None
    mean, eps = (a.args[0], a.args[1]) if isinstance(a.args[0], fx.Node) else (a.args[1], a.args[0])
    if not isinstance(eps, (int, float)) or not _is(mean, aten.mean.dim) or not _only_use(mean, a):
        return None
    pw = mean.args[0]
    dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    keep = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if not _is(pw, aten.pow.Tensor_Scalar) or pw.args[1] != 2 or not _only_use(pw, mean) or not keep:
        return None
    xf = pw.args[0]
    nd = _val(xf).dim()
    if list(dims or ()) not in ([-1], [nd - 1]) or len(r.users) != 1:
        return None
    m = next(iter(r.users))
    if not _is(m, aten.mul.Tensor) or set(m.args) != {xf, r}:
        return None
    hidden = _val(xf).shape[-1]
    absorbed = [pw, mean, a, r, m]
    # the tail: a cast to the input's dtype and a weight, in either order
    out, weight, offset, cast = m, None, 0.0, False
    while len(out.users) == 1:
        nxt = next(iter(out.users))
        if not cast and _is(nxt, *_CAST) and nxt.args[0] is out:
            cast = True
        elif weight is None and _is(nxt, aten.mul.Tensor) and len(nxt.args) == 2:
            other = nxt.args[1] if nxt.args[0] is out else nxt.args[0]
            if not _tensor(other) or tuple(_val(other).shape) != (hidden,):
                break
            weight, offset = other, 0.0
            if _is(other, aten.add.Tensor) and other.args[1] in (1, 1.0) and _only_use(other, nxt):
                base = other.args[0]
                if _float32_cast(base) and _only_use(base, other):
                    absorbed.append(base)
                    base = base.args[0]
                if _tensor(base) and tuple(_val(base).shape) == (hidden,):
                    weight, offset = base, 1.0
                    absorbed.append(other)
        else:
            break
        absorbed.append(nxt)
        out = nxt
    x = xf.args[0] if _float32_cast(xf) else xf
    if xf is not x:
        absorbed.insert(0, xf)  # erased only if nothing else reads it (the residual's own cast)
    pair = _residual(x)
    if pair is not None:
        return _Match(
            torch.ops.autopar.rms_norm.default, (pair[0], pair[1], weight, float(eps), offset), out,
            absorbed + [x], second=x,
        )  # fmt: skip
    return _Match(torch.ops.autopar.rms_norm.default, (x, None, weight, float(eps), offset), out, absorbed)


def _match_layer_norm(ln: fx.Node) -> _Match | None:
    if not _is(ln, aten.layer_norm.default):
        return None
    x = ln.args[0]
    shape = ln.args[1] if len(ln.args) > 1 else ln.kwargs.get("normalized_shape")
    pair = _residual(x) if isinstance(x, fx.Node) else None
    if pair is None or len(list(shape)) != 1:
        return None  # without the add, aten's layer_norm is one kernel already: nothing to fuse
    w = ln.args[2] if len(ln.args) > 2 else ln.kwargs.get("weight")
    b = ln.args[3] if len(ln.args) > 3 else ln.kwargs.get("bias")
    eps = ln.args[4] if len(ln.args) > 4 else ln.kwargs.get("eps", 1e-5)
    return _Match(
        torch.ops.autopar.layer_norm.default, (pair[0], pair[1], w, b, float(eps)), ln, [ln, x], second=x
    )


def _match_gated(act_targets, op) -> Callable[[fx.Node], _Match | None]:
    def match(m: fx.Node) -> _Match | None:
        if not _is(m, aten.mul.Tensor) or len(m.args) != 2 or m.kwargs:
            return None
        for act, up in (m.args, m.args[::-1]):
            if _is(act, *act_targets) and _only_use(act, m) and _tensor(up) and _tensor(act.args[0]):
                gate = act.args[0]
                if tuple(_val(gate).shape) != tuple(_val(up).shape) != tuple(_val(m).shape):
                    continue
                if tuple(_val(gate).shape) != tuple(_val(m).shape):
                    continue
                extra = ()
                if act.target is aten.gelu.default:
                    extra = (act.kwargs.get("approximate", act.args[1] if len(act.args) > 1 else "none"),)
                return _Match(op(), (gate, up, *extra), m, [act, m])
        return None

    return match


def _slice_of(n, x: fx.Node, start: int, end: int) -> bool:
    if not _is(n, aten.slice.Tensor) or n.args[0] is not x:
        return False
    nd = _val(x).dim()
    dim = n.args[1] if len(n.args) > 1 else 0
    lo = n.args[2] if len(n.args) > 2 else 0
    hi = n.args[3] if len(n.args) > 3 else None
    size = _val(x).shape[-1]
    hi = size if hi is None or hi >= size else hi
    return dim in (-1, nd - 1) and lo == start and hi == end


def _half_of(n, x: fx.Node, which: int) -> list[fx.Node] | None:
    """The nodes that make ``n`` the first (``which`` 0) or second half of ``x``'s last dim: a
    ``slice``, or ``getitem`` of ``chunk(x, 2, -1)`` (then the chunk too); else None."""
    d = _val(x).shape[-1]
    if _slice_of(n, x, which * d // 2, (which + 1) * d // 2):
        return [n]
    if _is(n, operator.getitem) and n.args[1] == which and _is(n.args[0], aten.chunk.default):
        ch = n.args[0]
        dim = ch.args[2] if len(ch.args) > 2 else ch.kwargs.get("dim", 0)
        if ch.args[0] is x and ch.args[1] == 2 and dim in (-1, _val(x).dim() - 1) and len(ch.users) == 2:
            return [n, ch]
    return None


def _source_of_half(n) -> fx.Node | None:
    if _is(n, aten.slice.Tensor):
        return n.args[0]
    if _is(n, operator.getitem) and _is(n.args[0], aten.chunk.default):
        return n.args[0].args[0]
    return None


def _match_rope(add: fx.Node) -> _Match | None:
    if not _is(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs:
        return None
    for m1, m2 in (add.args, add.args[::-1]):
        if not (_is(m1, aten.mul.Tensor) and _is(m2, aten.mul.Tensor)):
            continue
        if not (_only_use(m1, add) and _only_use(m2, add)):
            continue
        for cat, sin in (m2.args, m2.args[::-1]):
            if not _is(cat, aten.cat.default) or not _only_use(cat, m2) or not _tensor(sin):
                continue
            parts = cat.args[0]
            dim = cat.args[1] if len(cat.args) > 1 else 0
            if len(parts) != 2 or not _is(parts[0], aten.neg.default):
                continue
            neg, lo = parts
            hi = neg.args[0]
            x = _source_of_half(hi)
            if x is None or not _tensor(x) or dim not in (-1, _val(x).dim() - 1) or _val(x).shape[-1] % 2:
                continue
            upper, lower = _half_of(hi, x, 1), _half_of(lo, x, 0)
            if upper is None or lower is None:
                continue
            if not (_only_use(neg, cat) and _only_use(hi, neg) and _only_use(lo, cat)):
                continue
            if x not in m1.args:
                continue
            d = _val(x).shape[-1]
            cos = m1.args[1] if m1.args[0] is x else m1.args[0]
            if not _tensor(cos) or _val(cos).shape[-1] != d or _val(sin).shape[-1] != d:
                continue
            return _Match(
                torch.ops.autopar.rope.default, (x, cos, sin), add, [m1, *upper, *lower, neg, cat, m2, add]
            )
    return None


_REDUCTIONS = {1: "mean", 2: "sum"}
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _match_linear_cross_entropy(ce: fx.Node) -> _Match | None:
    if not _is(ce, aten.cross_entropy_loss.default):
        return None
    args = list(ce.args) + [None] * (6 - len(ce.args))
    logits, labels = args[0], args[1]
    weight = args[2] if args[2] is not None else ce.kwargs.get("weight")
    reduction = args[3] if args[3] is not None else ce.kwargs.get("reduction", 1)
    ignore = args[4] if args[4] is not None else ce.kwargs.get("ignore_index", -100)
    smoothing = args[5] if args[5] is not None else ce.kwargs.get("label_smoothing", 0.0)
    if weight is not None or smoothing or reduction not in _REDUCTIONS or not _tensor(labels):
        return None
    # from the loss back to the projection: a flattening view and a cast to float32, in either
    # order, each read by the next alone
    absorbed, node, user, seen = [], logits, ce, set()
    while not _is(node, aten.linear.default):
        if not isinstance(node, fx.Node) or not _only_use(node, user):
            return None
        if _is(node, *_VIEWS) and "view" not in seen:
            seen.add("view")
        elif _float32_cast(node) and "cast" not in seen:
            seen.add("cast")
        else:
            return None
        absorbed.insert(0, node)
        node, user = node.args[0], node
    lin = node
    if "view" not in seen or not _only_use(lin, user):
        return None
    bias = lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")
    h, w = lin.args[0], lin.args[1]
    if bias is not None or not (_tensor(h) and _tensor(w)) or _val(w).dim() != 2:
        return None
    if _val(labels).dim() != 1 or _val(logits).dim() != 2:
        return None
    return _Match(
        torch.ops.autopar.linear_cross_entropy.default,
        (h, w, labels, int(ignore), _REDUCTIONS[reduction], 0),
        ce,
        [lin, *absorbed, ce],
    )


_MATCHERS: dict[Kernel, Callable[[fx.Node], _Match | None]] = {
    Kernel.RMS_NORM: _match_rms_norm,
    Kernel.LAYER_NORM: _match_layer_norm,
    Kernel.SWIGLU: _match_gated((aten.silu.default,), lambda: torch.ops.autopar.swiglu.default),
    Kernel.GEGLU: _match_gated((aten.gelu.default,), lambda: torch.ops.autopar.geglu.default),
    Kernel.ROPE: _match_rope,
    Kernel.LINEAR_CROSS_ENTROPY: _match_linear_cross_entropy,
}


# -- rewriting --------------------------------------------------------------------------------------


def _fake_run(op, args: tuple):
    vals = tuple(_val(a) if isinstance(a, fx.Node) else a for a in args)
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        return op(*vals)
    with mode:
        return op(*vals)


def _same(a, b) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and tuple(a.shape) == tuple(b.shape)
        and a.dtype == b.dtype
    )


def _rewrite(g: fx.Graph, kernel: Kernel, m: _Match) -> KernelUse | None:
    args = m.args
    if kernel is Kernel.LINEAR_CROSS_ENTROPY:
        h = args[0]
        width = _val(h).shape[-1]
        if _val(h).dim() != 2:  # the rows of every position: [..., H] -> [N, H]
            with g.inserting_after(h):
                flat = g.call_function(aten.view.default, (h, [-1, width]))
            flat.meta["val"] = _fake_run(aten.view.default, (h, [-1, width]))
            args = (flat,) + args[1:]
            if _val(flat).shape[0] != _val(args[2]).shape[0]:
                g.erase_node(flat)
                return None
    try:
        fake = _fake_run(m.op, args)
    except Exception:  # noqa: BLE001 - a shape or dtype the kernel does not take: leave the pattern
        return None
    outs = tuple(fake) if isinstance(fake, (tuple, list)) else (fake,)
    want = _val(m.out)
    # a loss of half-precision logits (no float() before it): the fused loss, computed in float32,
    # cast to the loss's dtype as the pattern returns it
    recast = (
        kernel is Kernel.LINEAR_CROSS_ENTROPY
        and isinstance(want, torch.Tensor)
        and want.dtype != outs[0].dtype
        and want.dtype.is_floating_point
    )
    if recast:
        outs = (outs[0].to(want.dtype), *outs[1:])
    if not _same(outs[0], _val(m.out)) or (m.second is not None and not _same(outs[1], _val(m.second))):
        return None
    order = {n: i for i, n in enumerate(g.nodes)}
    inputs = [a for a in args if isinstance(a, fx.Node)]
    last = max(inputs, key=order.__getitem__)
    with g.inserting_after(last):
        node = g.call_function(m.op, args)
    node.meta["val"] = fake
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in m.out.meta:
            node.meta[key] = m.out.meta[key]
    first = node
    if isinstance(fake, (tuple, list)):
        with g.inserting_after(node):
            first = g.call_function(operator.getitem, (node, 0))
        first.meta["val"] = fake[0]
        if m.second is not None:
            with g.inserting_after(first):
                second = g.call_function(operator.getitem, (node, 1))
            second.meta["val"] = fake[1]
            m.second.replace_all_uses_with(second)
    if recast:
        with g.inserting_after(first):
            cast = g.call_function(aten.to.dtype, (first, want.dtype))
        cast.meta["val"] = outs[0]
        first = cast
    m.out.replace_all_uses_with(first)
    replaced = []
    for n in sorted(set(m.absorbed), key=order.__getitem__, reverse=True):
        if not n.users:
            replaced.append(n.name)
            g.erase_node(n)
    for n in list(node.users):  # an output no one reads (the sum, where only the norm read it)
        if n.target is operator.getitem and not n.users:
            g.erase_node(n)
    return KernelUse(kernel, node.name, tuple(reversed(replaced)))


# -- which kernels, and a plan's kernels again -------------------------------------------------------


# per device kind, the kernels a search fuses when ``SearchOptions.kernels`` does not say: every
# kernel on accelerators (Triton runs there), none on CPUs, where the torch fallbacks would run
# the same arithmetic as the aten ops they replace
AUTO_KERNELS: dict[DeviceKind, frozenset[Kernel]] = {
    DeviceKind.CUDA: frozenset(Kernel),
    DeviceKind.CPU: frozenset(),
}


def chosen_kernels(kind: DeviceKind, requested: frozenset[Kernel] | None) -> frozenset[Kernel]:
    """The kernels a search fuses on devices of ``kind`` (``DeviceSpec.kind``): those requested
    (``SearchOptions.kernels``), else (auto) ``AUTO_KERNELS``'s (UnsupportedDeviceKindError for a
    kind it lacks)."""
    if requested is not None:
        return requested
    return per_kind(AUTO_KERNELS, kind, "default fused kernels", "passes/fuse.py AUTO_KERNELS")


def fuse_as_planned(tg: TracedGraph, planned: tuple[KernelUse, ...]) -> None:
    """Rewrite ``tg`` as the plan's search rewrote its graph: the same kernels at the same nodes;
    ``PlanMismatchError`` where this graph gives other substitutions (another model, or a plan
    edited by hand)."""
    from autopar.errors import PlanMismatchError

    got = fuse(tg, {u.kernel for u in planned})
    if tuple(got) != tuple(planned):
        theirs = {u.node for u in planned} ^ {u.node for u in got}
        raise PlanMismatchError(
            f"the plan fuses kernels at nodes this graph does not match (first differences: {sorted(theirs)[:4]}); "
            "re-plan for this model and these inputs"
        )
    tg.kernels = got
