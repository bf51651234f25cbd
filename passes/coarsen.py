"""Coarsening: nodes of repeated blocks (identical transformer layers) share one set of ILP variables.

Two nodes are in the same *class* when they do the same thing in the same place of a repeated
module: same module path once layer indices are erased (``model.layers.3.mlp`` ->
``model.layers.#.mlp``), same op, same input and output shapes, same non-tensor arguments, same
need for gradients, and the same ordinal among such nodes inside their concrete module. Parameters
are grouped the same way by their FQN. Every member of a class then takes the same strategy: the
ILP is solved over classes, each class's costs multiplied by its size, each group of edges between
two classes solved once with its multiplicity (``costs.build_costs``). Solve time so barely changes
with depth; the restriction (all layers alike) is what hand-written plans do too.
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


def _arg_signature(node: fx.Node) -> str:
    def fmt(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            return f"T{tuple(v.shape)}" if isinstance(v, torch.Tensor) else "N"
        if isinstance(a, (list, tuple)):
            return "(" + ",".join(fmt(x) for x in a) + ")"
        return repr(a)

    return fmt(node.args) + fmt(tuple(sorted(node.kwargs.items())))


def find_classes(tg: TracedGraph, infos: dict[str, NodeInfo], names: list[str]) -> Classes:
    """Group ``names`` (nodes that carry ILP variables) into classes of repeated-block twins."""
    nodes = {n.name: n for n in tg.graph.nodes}
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
            else:
                concrete = (path, *base[1:])
                key = (*base, ordinal[concrete])
                ordinal[concrete] += 1
        r = by_key.setdefault(key, name)
        rep[name] = r
        members[r].append(name)
    return Classes(rep, dict(members))
