"""Analyze: per-node shapes, dtypes, FLOPs, bytes, roles, and whether a value needs a gradient.

FLOPs come from ``torch.utils.flop_counter`` (the forward of each node run once on meta tensors,
cached per distinct (op, shapes, dtypes, scalar args)). Bytes are the sizes of the node's tensor
inputs plus outputs: what a memory-bound kernel moves. What each op keeps for its backward (which
inputs, its output, internal tensors) is read the same way, through ``saved_tensors_hooks``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from autopar.passes.trace import Role, TracedGraph

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeInfo:
    name: str
    role: Role
    target: str  # FQN / input path for placeholders, op name for call_function
    shapes: tuple[tuple[int, ...], ...]  # every tensor output
    dtype: torch.dtype | None
    flops: float  # forward FLOPs of the global op
    bytes: int  # forward bytes moved (tensor inputs + outputs)
    requires_grad: bool
    saves_inputs: tuple[bool, ...] = ()  # per tensor input (rules.tensor_inputs order): kept for backward
    saves_output: bool = False  # the op keeps its own output for backward (tanh, softmax, ...)
    saved_temp_bytes: int = (
        0  # tensors the op keeps that are neither inputs nor outputs (sdpa's logsumexp ...)
    )

    @property
    def shape(self) -> tuple[int, ...]:
        return self.shapes[0] if self.shapes else ()

    @property
    def out_bytes(self) -> int:
        if self.dtype is None:
            return 0
        item = torch.empty((), dtype=self.dtype).element_size()
        return sum(_numel(s) for s in self.shapes) * item


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def tensor_vals(val) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(val) if isinstance(v, torch.Tensor)]


def tensor_nbytes(t: torch.Tensor) -> int:
    return _numel(t.shape) * t.element_size()


_FLOP_CACHE: dict = {}


def _flops_of(node: fx.Node) -> float:
    if not isinstance(node.target, torch._ops.OpOverload):
        return 0.0
    key = _signature(node)
    if key in _FLOP_CACHE:
        return _FLOP_CACHE[key]

    def to_meta(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return torch.empty(v.shape, dtype=v.dtype, device="meta")
            return v
        if isinstance(a, torch.device):
            return torch.device("meta")
        return a

    flops = 0.0
    try:
        args, kwargs = pytree.tree_map(to_meta, (node.args, node.kwargs))
        if "device" in kwargs:
            kwargs["device"] = torch.device("meta")
        counter = FlopCounterMode(display=False)
        with counter:
            node.target(*args, **kwargs)
        flops = float(counter.get_total_flops())
    except Exception as e:  # noqa: BLE001 - ops that cannot run on meta are priced by bytes only
        log.debug("no FLOP count for %s: %s", node.target, e)
    _FLOP_CACHE[key] = flops
    return flops


_SAVED_CACHE: dict = {}


def _signature(node: fx.Node):
    def key_of(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            return ("T", tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else ("N", a.name)
        return repr(a)

    return (str(node.target), repr(pytree.tree_map(key_of, (node.args, node.kwargs))))


def _saved_for_backward(node: fx.Node) -> tuple[tuple[bool, ...], bool, int]:
    """What autograd keeps for this op's backward, found by running it once on meta tensors under
    ``saved_tensors_hooks`` (cached per op signature). An op that cannot run so keeps every input."""
    key = _signature(node)
    if key in _SAVED_CACHE:
        return _SAVED_CACHE[key]
    if node.target is torch.ops.aten.scaled_dot_product_attention.default:
        # the fused kernels that run (flash / memory-efficient on GPU, flash on CPU) keep q, k, v, the
        # output and a float32 log-sum-exp per query row; on meta the math path would claim the S x S matrix
        q = node.args[0].meta["val"]
        n_in = sum(1 for a in node.args[:4] if isinstance(a, fx.Node))
        _SAVED_CACHE[key] = ((True,) * n_in, True, _numel(q.shape[:-1]) * 4)
        return _SAVED_CACHE[key]
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    n_in = sum(1 for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor))
    result: tuple[tuple[bool, ...], bool, int] = ((True,) * n_in, False, 0)
    if isinstance(node.target, torch._ops.OpOverload):
        try:
            ins: list[torch.Tensor] = []

            def to_meta(a):
                if isinstance(a, fx.Node):
                    v = a.meta.get("val")
                    if isinstance(v, torch.Tensor):
                        t = torch.empty(v.shape, dtype=v.dtype, device="meta").requires_grad_(
                            v.dtype.is_floating_point
                        )
                        ins.append(t)
                        return t
                    return v
                return torch.device("meta") if isinstance(a, torch.device) else a

            args, kwargs = pytree.tree_map(to_meta, (node.args, node.kwargs))
            if "device" in kwargs:
                kwargs["device"] = torch.device("meta")
            saved: list[torch.Tensor] = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
                out = node.target(*args, **kwargs)

            def sid(t):
                return t.untyped_storage()._cdata

            in_ids = [sid(t) for t in ins]
            out_ids = {sid(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)}
            saves, saves_out, temp = [False] * len(ins), False, 0
            for t in saved:
                if sid(t) in in_ids:
                    saves[in_ids.index(sid(t))] = True
                elif sid(t) in out_ids:
                    saves_out = True
                else:
                    temp += tensor_nbytes(t)
            result = (tuple(saves), saves_out, temp)
        except Exception as e:  # noqa: BLE001 - cannot run on meta: assume every input is kept
            log.debug("no saved-tensor probe for %s: %s", node.target, e)
    _SAVED_CACHE[key] = result
    return result


def analyze(tg: TracedGraph) -> dict[str, NodeInfo]:
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
            saves_in, saves_out, temp = _saved_for_backward(node) if rg else ((), False, 0)
            infos[node.name] = NodeInfo(
                node.name,
                Role.ACTIVATION,
                str(node.target),
                shapes,
                dtype,
                _flops_of(node),
                in_bytes + out_bytes,
                rg,
                saves_in,
                saves_out,
                temp,
            )
        elif node.op == "output":
            infos[node.name] = NodeInfo(node.name, Role.OUTPUT, "output", (), None, 0.0, 0, False)
        else:  # get_attr (e.g. submodules of higher-order ops)
            infos[node.name] = NodeInfo(
                node.name, Role.BUFFER, str(node.target), shapes, dtype, 0.0, 0, False
            )
    return infos
