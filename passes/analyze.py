"""Analyze: per-node shapes, dtypes, FLOPs, bytes, roles, and whether a value needs a gradient.

FLOPs come from ``torch.utils.flop_counter`` (the forward of each node run once on meta tensors,
cached per distinct (op, shapes, dtypes, scalar args)). Bytes are the sizes of the node's tensor
inputs plus outputs: what a memory-bound kernel moves. What each op keeps for its backward (which
inputs, its output, internal tensors, each counted once) is read the same way, through
``saved_tensors_hooks``, with only the inputs that need a gradient in the model requiring one
(autograd keeps less for the others); and what its backward allocates, by running
``torch.autograd.grad`` on the meta outputs: which input gradients are new tensors and what other
new tensors it holds at once. An output that shares an input's storage in the traced values (a
view, ``to`` to its own dtype, ``reshape`` or ``contiguous`` that need no copy) is marked
``view_of`` that input: it allocates nothing.

No silent mispricing. A probe that cannot run (an op without a meta kernel, one that needs
data-dependent values: the exceptions in ``_PROBE_ERRORS``; anything else is a bug and propagates)
leaves the fallback figures (0 FLOPs: priced by bytes only; every input kept for backward, every
input gradient new) and says why in ``NodeInfo.unpriced`` ("flops: <error>", "saved tensors:
<error>"), with one WARNING per op kind and figure; ``autopar coverage`` lists such ops with the
reason. Call targets that are neither aten op overloads nor the wrapper higher-order ops
(``wrap_with_set_grad_enabled``, ``wrap_with_autocast``: probed with their submodule) are not
probed: those in ``KNOWN_UNPROBED`` carry their reason there (``operator.getitem``), any other is
unpriced. Strict mode
(``analyze(tg, strict=True)`` or ``AUTOPAR_STRICT_ANALYZE=1``, on for the whole test suite) raises
:class:`~autopar.errors.UnpricedOpError` instead, naming the op, the node and the fix.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from autopar.cost_model.compute import GEMM_OPS
from autopar.errors import UnpricedOpError
from autopar.passes.rules import ALIASING_OPS, tensor_inputs, writes_inputs
from autopar.passes.trace import Role, TracedGraph, retarget_region

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeInfo:
    name: str
    role: Role
    target: str  # FQN / input path for placeholders, op name for call_function
    shapes: tuple[tuple[int, ...], ...]  # every tensor output
    dtype: torch.dtype | None
    flops: float  # forward FLOPs of the global op
    bytes: int  # forward bytes moved (tensor inputs + outputs; 0 for a view: it moves nothing)
    requires_grad: bool
    saves_inputs: tuple[bool, ...] = ()  # per tensor input (rules.tensor_inputs order): kept for backward
    saves_output: bool = False  # the op keeps its own output for backward (tanh, softmax, ...)
    saved_temp_bytes: int = (
        0  # tensors the op keeps that are neither inputs nor outputs (sdpa's logsumexp ...)
    )
    view_of: str = ""  # the input whose storage the output is a view of ("" if it allocates)
    grad_new: tuple[bool, ...] = ()  # per tensor input: its gradient is a new tensor (else passed on)
    grad_temp_bytes: int = 0  # other tensors the backward holds at once, at most (CE's log-prob gradient)
    # why a figure above is a fallback, not derived: "flops: <why>", "saved tensors: <why>" ("" none)
    unpriced: tuple[str, ...] = ()
    # the dtype its reshards move, where not its own: the half type under mixed precision where
    # every use casts it so (``passes/half_reshard.py``, set by ``passes/precision.py:half_infos``)
    moved_dtype: torch.dtype | None = None
    # per tensor output of an op with several: the op itself keeps it for backward (empty: one
    # output, or it keeps none); ``autopar::rms_norm`` keeps the residual sum, not the normed value
    saved_outputs: tuple[bool, ...] = ()
    # a GEMM's operands' dtype where it differs from its output's (the fused output projection +
    # loss returns an fp32 loss from bf16 operands): the rate its arithmetic runs at (``rate_dtype``)
    operand_dtype: torch.dtype | None = None

    @property
    def rate_dtype(self) -> torch.dtype | None:
        """The dtype whose peak the op's arithmetic runs at: its own, or a GEMM's operands' where
        they are narrower (a bf16 product accumulated into an fp32 output runs on the bf16 tensor
        cores). Under mixed precision ``dtype`` is already the half type (``half_infos``)."""
        o, d = self.operand_dtype, self.dtype
        if o is not None and d is not None and o.itemsize < d.itemsize:
            return o
        return d

    @property
    def shape(self) -> tuple[int, ...]:
        return self.shapes[0] if self.shapes else ()

    @functools.cached_property
    def out_bytes(self) -> int:  # read some 650,000 times planning a 32-layer llama on 64 devices
        if self.dtype is None:
            return 0
        return sum(_numel(s) for s in self.shapes) * self.dtype.itemsize

    def output_bytes(self, k: int) -> int:
        """Bytes of tensor output ``k`` (``out_bytes`` is their sum)."""
        return _numel(self.shapes[k]) * self.dtype.itemsize if self.dtype is not None else 0

    @functools.cached_property
    def moved_bytes(self) -> int:
        """Bytes its reshards move (and their consumers keep): ``out_bytes`` in ``moved_dtype``."""
        if self.moved_dtype is None or self.dtype is None:
            return self.out_bytes
        return self.out_bytes * self.moved_dtype.itemsize // self.dtype.itemsize


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def tensor_vals(val) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(val) if isinstance(v, torch.Tensor)]


def tensor_nbytes(t: torch.Tensor) -> int:
    return _numel(t.shape) * t.element_size()


STRICT_ENV = "AUTOPAR_STRICT_ANALYZE"

# Call targets that are not probed, and why their fallback figures (0 FLOPs; every input kept for
# backward, every input gradient new) are what they are rather than a guess. Add an op here only
# with its reason; an op that merely fails to probe wants a derivation instead.
KNOWN_UNPROBED: dict[object, str] = {
    operator.getitem: "selects one value of its producer's tuple: no FLOPs, no bytes of its own; "
    "what the backward keeps is its producer's",
}

# What a meta-device probe can legitimately raise: an op without a meta kernel
# (NotImplementedError), one that refuses meta tensors or needs data-dependent values
# (RuntimeError and its subclasses), or arguments it does not accept once rebuilt on meta
# (TypeError, ValueError). Anything else is a bug in the probe and propagates.
_PROBE_ERRORS = (NotImplementedError, RuntimeError, TypeError, ValueError)

_FLOP_CACHE: dict = {}
_WARNED: set[tuple[str, str]] = set()


def strict_default() -> bool:
    """Strict analysis (an underivable figure raises :class:`UnpricedOpError`) unless asked
    otherwise: on when the environment variable ``AUTOPAR_STRICT_ANALYZE`` is set to 1 / true."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _why(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:200]}"


# Higher-order ops that only run their submodule under a grad / autocast setting (a no-grad rotary
# embedding block, an autocast region): probed like an aten op, their submodule resolved from the
# graph module, so its FLOPs and what it saves are its body's (none under no_grad).
_WRAPPER_HOPS = tuple(
    h
    for h in (
        getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None),
        getattr(torch.ops.higher_order, "wrap_with_autocast", None),
    )
    if h is not None
)


def _probed(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) or node.target in _WRAPPER_HOPS


def _not_probed(node: fx.Node) -> str:
    return f"{node.target} is not an aten op overload: no probe"


def _submodule(a: fx.Node):
    """The attribute a ``get_attr`` node reads (a higher-order op's submodule)."""
    obj = a.graph.owning_module
    for part in str(a.target).split("."):
        obj = getattr(obj, part)
    return obj


_ON_META: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _on_meta(sub):
    """A region's submodule whose device arguments are the meta device, so that it runs on meta
    inputs (the traced one names the device it was traced on: ``to(device=cpu)`` of a meta
    tensor cannot run)."""
    if not isinstance(sub, fx.GraphModule):
        return sub
    if sub not in _ON_META:
        meta = torch.device("meta")
        _ON_META[sub] = retarget_region(sub, lambda g: meta)
    return _ON_META[sub]


def _meta_args(node: fx.Node):
    def to_meta(a):
        if isinstance(a, fx.Node):
            if a.op == "get_attr":
                return _on_meta(_submodule(a))
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return torch.empty(v.shape, dtype=v.dtype, device="meta")
            return v
        if isinstance(a, torch.device):
            return torch.device("meta")
        return a

    args, kwargs = pytree.tree_map(to_meta, (node.args, node.kwargs))
    kwargs = dict(kwargs)  # a node's kwargs map is immutable
    if "device" in kwargs:
        kwargs["device"] = torch.device("meta")
    return args, kwargs


def _flops_of(node: fx.Node) -> tuple[float, str]:
    """Forward FLOPs of ``node``'s op, and why they are not derived ("" when they are: then 0.0 is
    a real zero). An op that cannot run on meta is priced by bytes only (0 FLOPs), with the reason."""
    if not _probed(node):
        return 0.0, "" if node.target in KNOWN_UNPROBED else _not_probed(node)
    key = _signature(node)
    if key in _FLOP_CACHE:
        return _FLOP_CACHE[key]
    result = (0.0, "")
    try:
        args, kwargs = _meta_args(node)
        counter = FlopCounterMode(display=False)
        with counter:
            node.target(*args, **kwargs)
        result = (float(counter.get_total_flops()), "")
    except _PROBE_ERRORS as e:
        result = (0.0, _why(e))
    _FLOP_CACHE[key] = result
    return result


_SAVED_CACHE: dict = {}


def _signature(node: fx.Node):
    def key_of(a):
        if isinstance(a, fx.Node):
            if a.op == "get_attr":  # a higher-order op's body: by its code, not its name in a graph
                sub = _submodule(a)
                return ("G", sub.code if isinstance(sub, fx.GraphModule) else repr(sub))
            v = a.meta.get("val")
            return ("T", tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else ("N", a.name)
        return repr(a)

    return (str(node.target), repr(pytree.tree_map(key_of, (node.args, node.kwargs))))


@dataclass(frozen=True)
class _Probe:
    saves_inputs: tuple[bool, ...]
    saves_output: bool = False
    saved_temp_bytes: int = 0
    grad_new: tuple[bool, ...] = ()
    grad_temp_bytes: int = 0
    saved_outputs: tuple[bool, ...] = ()  # per tensor output, of an op with several: it keeps it


def _saved_for_backward(node: fx.Node, grads: tuple[bool, ...]) -> tuple[_Probe, str]:
    """What autograd keeps for this op's backward and what its backward allocates, found by running
    it once on meta tensors (cached per op signature), each tensor input requiring a gradient as in
    the model (``grads``, per tensor input): ``x * c`` with a constant ``c`` keeps ``c`` only.
    Forward under ``saved_tensors_hooks``: the saved tensors. Backward (``torch.autograd.grad``)
    under ``_NewStorage``: which input gradients are new tensors (``add`` passes its output's
    gradient on to both inputs) and the largest bytes of other new tensors held at once
    (``cross_entropy``: the gradient of its log-probabilities). An op that cannot run so keeps
    every input and allocates every input gradient; the second value says why ("" when derived)."""
    key = (_signature(node), grads)
    if key in _SAVED_CACHE:
        return _SAVED_CACHE[key]
    tins = tensor_inputs(node)
    mask_grad = any(g for a, g in zip(tins, grads) if a not in node.args[:3])
    if node.target is torch.ops.aten.scaled_dot_product_attention.default and not mask_grad:
        # the fused kernels that run (flash / memory-efficient on GPU, flash on CPU) keep q, k, v, the
        # output and a float32 log-sum-exp per query row, and allocate only the gradients of q, k, v
        # (on CPU); on meta the math path would claim the S x S matrix. A boolean mask is kept as
        # the additive float mask it is turned into (query dtype, the mask's shape). A mask that needs
        # a gradient (T5's learned position bias) makes torch run the math path: probed on meta.
        q = node.args[0].meta["val"]
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        saves, temp = [], _numel(q.shape[:-1]) * 4
        for a in tins:
            v = a.meta["val"]
            if a is mask and not v.dtype.is_floating_point:
                saves.append(False)
                temp += _numel(v.shape) * q.element_size()
            else:
                saves.append(True)
        _SAVED_CACHE[key] = (_Probe(tuple(saves), True, temp, tuple(a is not mask for a in tins)), "")
        return _SAVED_CACHE[key]
    fallback = _Probe((True,) * len(tins), grad_new=(True,) * len(tins))
    if not _probed(node):
        result = (fallback, "" if node.target in KNOWN_UNPROBED else _not_probed(node))
    else:
        try:
            result = (_run_probe(node, grads), "")
        except _PROBE_ERRORS as e:  # cannot run on meta: assume every input is kept
            result = (fallback, _why(e))
    _SAVED_CACHE[key] = result
    return result


def _run_probe(node: fx.Node, grads: tuple[bool, ...]) -> _Probe:
    ins: list[torch.Tensor] = []
    mutable = writes_inputs(node)

    def to_meta(a):
        if isinstance(a, fx.Node):
            if a.op == "get_attr":
                return _submodule(a)
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                rg = grads[len(ins)] if len(ins) < len(grads) else v.dtype.is_floating_point
                t = torch.empty(v.shape, dtype=v.dtype, device="meta")
                t.requires_grad_(rg and v.dtype.is_floating_point)
                if t.requires_grad and mutable:
                    t = t.clone()  # an in-place op may not write into a leaf that requires grad
                ins.append(t)
                return t
            return v
        return torch.device("meta") if isinstance(a, torch.device) else a

    args, kwargs = pytree.tree_map(to_meta, (node.args, node.kwargs))
    kwargs = dict(kwargs)  # a node's kwargs map is immutable
    if "device" in kwargs:
        kwargs["device"] = torch.device("meta")
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        out = node.target(*args, **kwargs)
    in_ids = [_sid(t) for t in ins]
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    out_ids = {_sid(t) for t in outs}
    saves, saves_out, temp, temps = [False] * len(ins), False, 0, set()
    kept_outs = [False] * len(outs)
    for t in saved:
        if _sid(t) in in_ids:
            saves[in_ids.index(_sid(t))] = True
        elif _sid(t) in out_ids:
            saves_out = True
            kept_outs = [k or _sid(o) == _sid(t) for k, o in zip(kept_outs, outs)]
        elif _sid(t) not in temps:  # one storage saved twice (log_softmax's output by nll_loss) is kept once
            temps.add(_sid(t))
            temp += t.untyped_storage().nbytes()
    # backward: which input gradients are new storage, and what else it holds at its peak
    diff = [t for t in outs if t.requires_grad]
    need = [i for i, t in enumerate(ins) if t.requires_grad]
    grad_new, grad_temp = [False] * len(ins), 0
    if diff and need:
        gouts = [torch.empty_like(t) for t in diff]
        tracker = _NewStorage(ins + outs + saved + gouts)
        with tracker:
            gins = torch.autograd.grad(diff, [ins[i] for i in need], gouts, allow_unused=True)
        new_ids: set[int] = set()
        for i, g in zip(need, gins):
            if g is not None and _sid(g) in tracker.sizes:
                grad_new[i] = True
                new_ids.add(_sid(g))
        grad_temp = max(0, tracker.peak - sum(tracker.sizes[k] for k in new_ids))
    which = tuple(kept_outs) if len(outs) > 1 and saves_out else ()
    return _Probe(tuple(saves), saves_out, temp, tuple(grad_new), grad_temp, which)


def _sid(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _NewStorage(TorchDispatchMode):
    """Bytes of storages allocated under it (on any device, meta included), live at once at most;
    storages of ``existing`` tensors (inputs, saved tensors) are not new, whatever views of them
    the backward makes."""

    def __init__(self, existing) -> None:
        super().__init__()
        self.old = {_sid(t) for t in existing}
        self.sizes: dict[int, int] = {}  # new storage -> bytes (kept after it dies: for the caller)
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def _release(self, k: int) -> None:
        self.refs[k] -= 1
        if not self.refs[k]:
            del self.refs[k]
            self.live -= self.sizes[k]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and _sid(t) not in self.old:
                k = _sid(t)
                if k not in self.refs:
                    self.refs[k] = 0
                    self.sizes[k] = t.untyped_storage().nbytes()
                    self.live += self.sizes[k]
                    self.peak = max(self.peak, self.live)
                self.refs[k] += 1
                weakref.finalize(t, self._release, k)
        return out


def _storage(v) -> int | None:
    try:
        return v.untyped_storage()._cdata if isinstance(v, torch.Tensor) else None
    except Exception:  # noqa: BLE001 - a value without a storage (some tensor subclasses): no alias
        return None


def _view_of(node: fx.Node, tins: list[fx.Node]) -> str:
    """The tensor input whose storage ``node``'s output shares, read from the traced (fake) values:
    views, and ops that return their input unchanged (``to`` to the same dtype, ``reshape`` or
    ``contiguous`` of a tensor that needs no copy). Such an output allocates nothing. Dropout with
    p = 0 (or not training) returns its input in eager mode (``at::dropout``), not in the trace."""
    if node.target in ALIASING_OPS and tins:
        return tins[0].name
    if node.target is torch.ops.aten.dropout.default and tins:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        if p == 0 or not train:
            return tins[0].name
    out = _storage(node.meta.get("val"))
    if out is None:
        return ""
    return next((a.name for a in tins if _storage(a.meta.get("val")) == out), "")


def _unpriced(node: fx.Node, flops_why: str, saved_why: str, strict: bool) -> tuple[str, ...]:
    """The node's reasons ("flops: ...", "saved tensors: ..."); a WARNING once per op kind and
    figure, or, in strict mode, :class:`UnpricedOpError`."""
    reasons = tuple(
        f"{what}: {why}" for what, why in (("flops", flops_why), ("saved tensors", saved_why)) if why
    )
    if reasons and strict:
        raise UnpricedOpError(
            f"cannot derive the {' and '.join(r.split(':')[0] for r in reasons)} of op {node.target} "
            f"(node {node.name}): {'; '.join(reasons)}. Fix: derive it in autopar/passes/analyze.py "
            "(a formula, or a probe that runs), or, if its figure is known to be zero / bytes-only, "
            "add the op to KNOWN_UNPROBED there with the reason. Without "
            f"{STRICT_ENV}=1 it is priced at the fallback (0 FLOPs; every input kept for backward) "
            "and listed by `autopar coverage`."
        )
    for r in reasons:
        what = r.split(":")[0]
        if (str(node.target), what) not in _WARNED:
            _WARNED.add((str(node.target), what))
            fallback = "0 FLOPs (bytes only)" if what == "flops" else "every input kept for backward"
            log.warning("%s: cannot derive its %s (%s): priced at %s", node.target, what, r, fallback)
    return reasons


def _operand_dtype(node: fx.Node, tins: list[fx.Node], dtype: torch.dtype | None) -> torch.dtype | None:
    """``NodeInfo.operand_dtype``: for a GEMM-family op (``cost_model.compute.GEMM_OPS``), its
    floating tensor inputs' narrowest dtype where that is not ``dtype`` (its output's); else None."""
    if str(node.target) not in GEMM_OPS:
        return None
    got = [v.dtype for a in tins for v in tensor_vals(a.meta.get("val")) if v.dtype.is_floating_point]
    narrow = min(got, key=lambda d: d.itemsize, default=None)
    return narrow if narrow is not None and narrow != dtype else None


def analyze(tg: TracedGraph, strict: bool | None = None) -> dict[str, NodeInfo]:
    """Per-node :class:`NodeInfo`. ``strict`` (default: :func:`strict_default`, the
    ``AUTOPAR_STRICT_ANALYZE`` environment variable) raises :class:`UnpricedOpError` for an op whose
    FLOPs or saved tensors cannot be derived; otherwise such a node keeps the fallback figures and
    says why in ``NodeInfo.unpriced``."""
    strict = strict_default() if strict is None else strict
    roles = {p.name: p for p in tg.placeholders}
    infos: dict[str, NodeInfo] = {}
    for node in tg.graph.nodes:
        vals = tensor_vals(node.meta.get("val"))
        dtype = vals[0].dtype if vals else None
        shapes = tuple(tuple(int(s) for s in v.shape) for v in vals)
        if node.op == "placeholder":
            p = roles[node.name]
            rg = p.role is Role.PARAM and bool(tg.state[p.target].requires_grad)
            infos[node.name] = NodeInfo(node.name, p.role, p.target, shapes, dtype, 0.0, 0, rg)
        elif node.op == "call_function":
            ins = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
            in_bytes = sum(tensor_nbytes(t) for a in ins for t in tensor_vals(a.meta.get("val")))
            out_bytes = sum(tensor_nbytes(v) for v in vals)
            rg = any(infos[a.name].requires_grad for a in ins if a.name in infos) and bool(
                vals and any(v.dtype.is_floating_point for v in vals)
            )
            tins = tensor_inputs(node)
            grads = tuple(infos[a.name].requires_grad if a.name in infos else True for a in tins)
            probe, saved_why = _saved_for_backward(node, grads) if rg else (_Probe(()), "")
            flops, flops_why = _flops_of(node)
            view_of = _view_of(node, tins)
            infos[node.name] = NodeInfo(
                node.name,
                Role.ACTIVATION,
                str(node.target),
                shapes,
                dtype,
                flops,
                0 if view_of else in_bytes + out_bytes,
                rg,
                probe.saves_inputs,
                probe.saves_output,
                probe.saved_temp_bytes,
                view_of,
                probe.grad_new,
                probe.grad_temp_bytes,
                _unpriced(node, flops_why, saved_why, strict),
                saved_outputs=probe.saved_outputs,
                operand_dtype=_operand_dtype(node, tins, dtype),
            )
        elif node.op == "output":
            infos[node.name] = NodeInfo(node.name, Role.OUTPUT, "output", (), None, 0.0, 0, False)
        else:  # get_attr (e.g. submodules of higher-order ops)
            infos[node.name] = NodeInfo(
                node.name, Role.BUFFER, str(node.target), shapes, dtype, 0.0, 0, False
            )
    return infos
