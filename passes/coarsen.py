"""Coarsening: nodes of repeated blocks (identical transformer layers) share one set of ILP variables.

Two nodes are in the same *class* when they do the same thing in the same place of a repeated
module: same module path once layer indices are erased (``model.layers.3.mlp`` ->
``model.layers.#.mlp``), same op, same input and output shapes, same non-tensor arguments, same
need for gradients, and the same ordinal among such nodes inside their concrete module. Parameters
are grouped the same way by their FQN. Every member of a class then takes the same strategy: the
ILP is solved over classes, each class's costs multiplied by its size, each group of edges between
two classes solved once with its multiplicity (``costs.build_costs``). Solve time so barely changes
with depth; the restriction (all layers alike) is what hand-written plans do too.

Unrolled loops coarsen the same way: a Python loop over a sequence (Mamba's selective scan as
Hugging Face runs it without its CUDA kernel, one ``select`` of each step's slice, then the same
few ops per step) traces as the same ops repeated once per step inside one module. Where a module
selects slices of one tensor shape along one dim at ``LOOP_MIN_STEPS`` or more indices
(``aten.select.int``), its ops that repeat that often (same op, shapes and arguments, a select's
index aside) are one class each, every step alike: the slice index does not change the
placements a select may take (``passes/rules/shape.py:slice_rule``). A 2-layer Mamba of 16 steps
has 104 classes so, not 244; its free 2 x 2 mesh under a memory limit was an ILP of 152,183
columns whose LP relaxation alone took 31 s and whose MIP did not finish in 15 minutes
(benchmarks/README.md, "Planning under a memory limit").
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.passes.analyze import NodeInfo
from autopar.passes.trace import Role, TracedGraph, module_path

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")
# a module that selects slices of one shape along one dim at this many indices runs an unrolled
# loop (module docstring); below it (a pair of halves, a few heads) its ops stay distinct nodes
LOOP_MIN_STEPS = 4


@dataclass(frozen=True)
class Classes:
    rep: dict[str, str]  # node name -> its class representative (the first member in graph order)
    members: dict[str, list[str]]  # representative -> every member, in graph order

    def count(self, rep: str) -> int:
        return len(self.members[rep])

    @classmethod
    def identity(cls, names: list[str]) -> Classes:
        return cls({n: n for n in names}, {n: [n] for n in names})


def erase_indices(path: str) -> str:
    return _INDEX.sub("#", path)


def _arg_signature(node: fx.Node, args: tuple | None = None) -> str:
    """The node's non-tensor arguments and its tensor arguments' shapes (``args``: in place of
    the node's own)."""

    def fmt(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            return f"T{tuple(v.shape)}" if isinstance(v, torch.Tensor) else "N"
        if isinstance(a, (list, tuple)):
            return "(" + ",".join(fmt(x) for x in a) + ")"
        return repr(a)

    return fmt(node.args if args is None else args) + fmt(tuple(sorted(node.kwargs.items())))


def _step_signature(node: fx.Node) -> str:
    """``_arg_signature`` with a select's index left out: the same op at every step of a loop."""
    if node.target is torch.ops.aten.select.int and len(node.args) >= 3:
        return _arg_signature(node, node.args[:2])
    return _arg_signature(node)


def loop_steps(tg: TracedGraph, infos: dict[str, NodeInfo], names: list[str]) -> dict[str, tuple]:
    """The nodes of ``names`` that are steps of an unrolled loop (module docstring), each with its
    class key: the module path with layer indices erased, op, shapes, step signature, gradient."""
    nodes = {n.name: n for n in tg.graph.nodes}
    keys: dict[str, tuple] = {}
    count: dict[tuple, int] = defaultdict(int)
    indices: dict[tuple, set] = defaultdict(set)  # a select's indices, by its step key
    looping: set[str] = set()  # the modules that select at LOOP_MIN_STEPS indices or more
    for name in names:
        node = nodes[name]
        path = module_path(node) if node.op == "call_function" else ""
        if not path:
            continue
        info = infos[name]
        keys[name] = (path, str(node.target), info.shapes, _step_signature(node), info.requires_grad)
        count[keys[name]] += 1
        if node.target is torch.ops.aten.select.int and len(node.args) >= 3:
            indices[keys[name]].add(node.args[2])
            if len(indices[keys[name]]) >= LOOP_MIN_STEPS:
                looping.add(path)
    return {
        name: (erase_indices(k[0]), *k[1:], "step")
        for name, k in keys.items()
        if k[0] in looping and count[k] >= LOOP_MIN_STEPS
    }


def find_classes(tg: TracedGraph, infos: dict[str, NodeInfo], names: list[str]) -> Classes:
    """Group ``names`` (nodes that carry ILP variables) into classes of repeated-block twins and
    of an unrolled loop's steps."""
    nodes = {n.name: n for n in tg.graph.nodes}
    steps = loop_steps(tg, infos, names)
    ordinal: dict[tuple, int] = defaultdict(int)
    by_key: dict[tuple, str] = {}
    rep, members = {}, defaultdict(list)
    for name in names:
        node, info = nodes[name], infos[name]
        if node.op == "placeholder":
            if info.role is Role.INPUT:
                key = ("input", name)
            else:
                key = (info.role.value, erase_indices(info.target), info.shapes, info.requires_grad)
        else:
            path = module_path(node)
            base = (
                erase_indices(path),
                str(node.target),
                info.shapes,
                _arg_signature(node),
                info.requires_grad,
            )
            if not path:  # outside any module: never merged
                key = ("top", name)
            elif name in steps:
                key = steps[name]
            else:
                concrete = (path, *base[1:])
                key = (*base, ordinal[concrete])
                ordinal[concrete] += 1
        r = by_key.setdefault(key, name)
        rep[name] = r
        members[r].append(name)
    return Classes(rep, dict(members))
