"""Analyze: per-node shapes, dtypes, FLOPs, bytes, roles, and whether a value needs a gradient.

FLOPs come from ``torch.utils.flop_counter`` (the forward of each node run once on meta tensors,
cached per distinct (op, shapes, dtypes, scalar args)). Bytes are the sizes of the node's tensor
inputs plus outputs: what a memory-bound kernel moves.
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

    def key_of(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            return ("T", tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else ("N", a.name)
        return repr(a)

    key = (str(node.target), repr(pytree.tree_map(key_of, (node.args, node.kwargs))))
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
            infos[node.name] = NodeInfo(
                node.name,
                Role.ACTIVATION,
                str(node.target),
                shapes,
                dtype,
                _flops_of(node),
                in_bytes + out_bytes,
                rg,
            )
        elif node.op == "output":
            infos[node.name] = NodeInfo(node.name, Role.OUTPUT, "output", (), None, 0.0, 0, False)
        else:  # get_attr (e.g. submodules of higher-order ops)
            infos[node.name] = NodeInfo(
                node.name, Role.BUFFER, str(node.target), shapes, dtype, 0.0, 0, False
            )
    return infos
