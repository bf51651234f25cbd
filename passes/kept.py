"""Which activation storages autograd (or the caller) keeps until backward, and who pays for them.

``passes/costs.py:build_costs`` charges kept bytes by these rules: a storage its own op saves at
its node, one only consumers keep on their edges (``Kept``). ``tests/test_kept_activations.py``
holds them against autograd's saved tensors, byte for byte.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.passes.analyze import NodeInfo
from autopar.passes.coarsen import Classes
from autopar.passes.rules import tensor_inputs
from autopar.passes.trace import Role, TracedGraph
from autopar.placement import volume_factor


def _base(node: fx.Node, infos: dict[str, NodeInfo]) -> fx.Node:
    """The node that owns the storage a view (or getitem, or an op returning its input) refers to."""
    while node.op == "call_function":
        if node.target is operator.getitem:
            node = node.args[0]
        elif infos.get(node.name) is not None and infos[node.name].view_of:
            view_of = infos[node.name].view_of
            node = next(a for a in node.all_input_nodes if a.name == view_of)
        else:
            break
    return node


def _base_output(node: fx.Node, infos: dict[str, NodeInfo]) -> fx.Node:
    """The storage a use of ``node`` keeps: ``_base``'s node, or, for one output of an op with several
    that the op does not keep itself (``NodeInfo.saved_outputs``), that output's ``getitem``: its own
    storage, which the op's backward never holds (``autopar::rms_norm`` keeps the residual sum; its
    normed value is kept by whoever saves it, or by nobody: under autocast its linears save their
    half-type casts of it)."""
    part = None
    while node.op == "call_function":
        if node.target is operator.getitem:
            part, node = node, node.args[0]
        elif infos.get(node.name) is not None and infos[node.name].view_of:
            view_of = infos[node.name].view_of
            node = next(a for a in node.all_input_nodes if a.name == view_of)
        else:
            break
    which = infos[node.name].saved_outputs if node.name in infos else ()
    if part is not None and isinstance(part.args[1], int) and part.args[1] < len(which):
        return node if which[part.args[1]] else part
    return node


@dataclass(frozen=True)
class Kept:
    """Which activation storages autograd (or the caller) keeps until backward, and who pays for them.

    A node's output is kept when an op saves it as an input (``NodeInfo.saves_inputs``; a saved view
    keeps its base), when an op saves its own output, or when it is a graph output (the caller holds
    outputs through backward, as ``out = model(x); out.loss.backward()`` does). A consumer that
    needs the tensor in another placement saves the resharded copy codegen makes for it, not the
    producer's tensor. So a storage that only consumers keep is paid on their edges (``keeper``:
    (consumer, input index) -> base; the graph output's index is its position among the output's
    inputs): a copy where the edge reshards, the storage itself where it does not, counted once
    however many consumers keep it as it is (``shared``: those with several keepers; a max over
    their edges, ``Edge.keep``; a GEMM's own half-type cast is its alone: ``cast_each``). A storage its own op saves is paid at its node (``at_node``): of an
    op with several outputs, the outputs it saves (``node_bytes``); another output is a storage of
    its own (its ``getitem``, ``_base_output``), paid by its keepers like any other (``source``:
    that ``getitem`` -> the op, whose class it is charged to)."""

    at_node: frozenset[str]
    keeper: dict[tuple[str, int], str]
    shared: frozenset[str]
    node_bytes: dict[str, int] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)
    # storages whose every use is an autocast GEMM under mixed precision: kept as half-type casts
    # (``kept_owner``), one per GEMM that takes it as it is and casts it itself; one for all where
    # the generated code casts it first, before a collective or the Megatron "f" of its uses
    # (``codegen/lower.py``, ``passes/half_reshard.py``): ``_edge``'s ``cast_each``
    cast_each: frozenset[str] = frozenset()
    # views (and ops returning their input) of an ``at_node`` storage whose output some op keeps
    # through them: where the edge into one reshards, the view is of the resharded copy, a new
    # storage, which is kept (a view of a gathered attention output that the output projection
    # saves); charged on that edge
    kept_views: frozenset[str] = frozenset()

    def at_node_bytes(self, name: str, info: NodeInfo) -> int:
        """Bytes of ``name``'s own outputs kept at it (0 when it is not in ``at_node``)."""
        if name not in self.at_node:
            return 0
        return self.node_bytes.get(name, info.out_bytes)


def kept_for_backward(tg: TracedGraph, infos: dict[str, NodeInfo]) -> Kept:
    uses: dict[str, list[tuple[str, int]]] = {}
    self_saved: set[str] = set()
    source: dict[str, str] = {}
    views: dict[str, set[str]] = {}  # storage -> the views its keepers keep it through

    def base_of(inp: fx.Node) -> str:
        v, seen = inp, []
        while v.op == "call_function" and infos.get(v.name) is not None and infos[v.name].view_of:
            seen.append(v.name)
            v = next(a for a in v.all_input_nodes if a.name == infos[v.name].view_of)
        b = _base_output(inp, infos)
        if b.target is operator.getitem:
            source[b.name] = b.args[0].name
        views.setdefault(b.name, set()).update(seen)
        return b.name

    for node in tg.graph.nodes:
        if node.op == "output":
            for k, inp in enumerate(node.all_input_nodes):
                if isinstance(inp.meta.get("val"), torch.Tensor):
                    uses.setdefault(base_of(inp), []).append(("output", k))
            continue
        info = infos.get(node.name)
        if node.op != "call_function" or info is None or not info.requires_grad:
            continue
        if info.saves_output:
            self_saved.add(_base(node, infos).name)
        for i, (inp, saved) in enumerate(zip(tensor_inputs(node), info.saves_inputs)):
            if saved:
                uses.setdefault(base_of(inp), []).append((node.name, i))
    at_node, keeper, shared = set(self_saved), {}, set()
    for base, users in uses.items():
        if base in self_saved or infos[base].role is not Role.ACTIVATION:
            at_node.add(base)
            continue
        keeper.update((u, base) for u in users)
        if len(users) > 1:
            shared.add(base)
    node_bytes = {
        b: sum(infos[b].output_bytes(k) for k, kept in enumerate(infos[b].saved_outputs) if kept)
        for b in at_node
        if infos[b].saved_outputs
    }
    cast_each = frozenset(b for b in keeper.values() if infos[b].moved_dtype is not None)
    return Kept(
        frozenset(at_node),
        keeper,
        frozenset(shared),
        node_bytes,
        source,
        cast_each,
        # only of a storage its own op keeps: its keepers pay nothing for it (a storage they keep
        # is charged on their edges, as it is where no reshard comes between: a copy there too)
        frozenset(v for b in at_node if infos[b].role is Role.ACTIVATION for v in views.get(b, ())),
    )


def kept_owner(kept: Kept, use: tuple[str, int], infos, classes: Classes) -> tuple[int, str]:
    """(bytes of the storage this use keeps when it takes it as it is, owner if others keep it too).
    A storage whose every use is an autocast GEMM under mixed precision is kept as the half-type
    cast each makes of it (``NodeInfo.moved_bytes``; ``passes/half_reshard.py``), not as itself."""
    base = kept.keeper.get(use)
    node = kept.source.get(base, base)
    if base is None or node not in classes.rep:
        return 0, ""
    return infos[base].moved_bytes, (classes.rep[node] if base in kept.shared else "")


def use_kept_bytes(have, need, nbytes: int, keeps: bool, orig: int, mesh_shape) -> tuple[float, float]:
    """Bytes per device a consumer keeps until backward by taking a tensor (``nbytes``) from
    placement ``have`` in placement ``need``: (the resharded copy, if it saves it; the producer's
    storage of ``orig`` bytes, if no collective runs and the consumer keeps it). The storage is cut
    as the tensor the consumer sees (a view of all of it, or a slice cut alike)."""
    if any(n > 1 and h != w for h, w, n in zip(have, need, mesh_shape)):
        return (nbytes / volume_factor(need, mesh_shape) if keeps else 0.0), 0.0
    return 0.0, orig / volume_factor(have, mesh_shape)
