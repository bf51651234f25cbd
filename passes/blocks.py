"""Repeated blocks: the spans of the traced graph that recomputation checkpoints and ZeRO-3 gathers by.

A block is one element of a repeated module list (``model.layers.3``, ``transformer.h.0``,
``encoder.block.5``): the shortest module path of a node that ends in an index (read off its
``nn_module_stack``) names its block, when that list has at least two elements in the graph.
A block's span is the run of ``call_function`` nodes from its first node to its last, in graph
order; a node inside the span with no block of its own (a view the exporter left outside any
module) belongs to it, and spans that overlap are merged, so blocks never interleave. What comes
before the first block (embeddings) and after the last (final norm, head, loss) is in no block.

``Block.inputs`` are the tensors the span reads from before it (the previous block's hidden
states, masks, rotary tables, but not parameters), ``Block.params`` the parameter placeholders it
reads: a checkpoint around a block keeps exactly its inputs; ZeRO-3 gathers exactly its params.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.passes.trace import Role, TracedGraph

_BLOCK = re.compile(r"^(.*?\.\d+)(?=\.|$)")


@dataclass(frozen=True)
class Block:
    index: int
    path: str  # module path of the block (the first one of a merged span)
    nodes: tuple[str, ...]  # call_function nodes of the span, in graph order
    inputs: tuple[str, ...]  # tensor nodes defined before the span that the span reads (no params)
    params: tuple[str, ...]  # parameter and buffer placeholders the span reads
    outputs: tuple[str, ...]  # span nodes read after the span


def _block_path(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    for path, _ in stack.values():
        m = _BLOCK.match(path.removeprefix("L['self']."))
        if m:
            return m[1]
    return None


def find_blocks(tg: TracedGraph) -> list[Block]:
    """The graph's repeated blocks in order (module docstring); empty when it has none."""
    nodes = [n for n in tg.graph.nodes if n.op == "call_function"]
    paths = {n.name: _block_path(n) for n in nodes}
    families: dict[str, set[str]] = {}
    for p in paths.values():
        if p:
            head, _, idx = p.rpartition(".")
            families.setdefault(head, set()).add(idx)
    repeated = {h for h, idxs in families.items() if len(idxs) >= 2}
    spans: list[list] = []  # [first, last, path]
    pos = {n.name: i for i, n in enumerate(nodes)}
    seen: dict[str, list] = {}
    for n in nodes:
        p = paths[n.name]
        if not p or p.rpartition(".")[0] not in repeated:
            continue
        if p in seen:
            seen[p][1] = pos[n.name]
        else:
            seen[p] = [pos[n.name], pos[n.name], p]
            spans.append(seen[p])
    spans.sort()
    merged: list[list] = []
    for s in spans:
        if merged and s[0] <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], s[1])
        else:
            merged.append(list(s))
    state = {p.name for p in tg.placeholders if p.role is not Role.INPUT}
    blocks = []
    for i, (a, b, path) in enumerate(merged):
        span = nodes[a : b + 1]
        names = {n.name for n in span}
        ins, params, outs = [], [], []
        for n in span:
            for x in n.all_input_nodes:
                if x.name in names:
                    continue
                target = params if x.name in state else ins
                if x.name not in target and isinstance(x.meta.get("val"), torch.Tensor):
                    target.append(x.name)
            if any(u.name not in names for u in n.users):
                outs.append(n.name)
        blocks.append(Block(i, path, tuple(names_in_order(span)), tuple(ins), tuple(params), tuple(outs)))
    return blocks


def between_blocks(graph: fx.Graph, blocks: list[Block]) -> dict[str, int]:
    """Each node after one block's span and before the next's (an encoder's final norm, a
    decoder's embedding and masks) -> the index of the block before it. A pipeline runs such a
    node with that block (``passes/pipeline.py:Regions``, ``codegen/pipeline.py``): it may be read
    by the next block, so it cannot wait for the stages after the last block, and whatever it
    hands on crosses the cut like a block's outputs."""
    if len(blocks) < 2:
        return {}
    start = {b.nodes[0]: b.index for b in blocks if b.nodes}
    end = {b.nodes[-1]: b.index for b in blocks if b.nodes}
    inside = {n for b in blocks for n in b.nodes}
    out: dict[str, int] = {}
    before: int | None = None  # the block whose span ended last, while no next block has begun
    for n in graph.nodes:
        if n.name in start:
            before = None
        if n.name in end:
            before = end[n.name]
        elif before is not None and n.name not in inside and before < blocks[-1].index:
            out[n.name] = before
    return out


def names_in_order(span: list[fx.Node]) -> list[str]:
    return [n.name for n in span]


# matmuls as the traced graph names them (attention is not one): what ``Recompute.HALF_MATMULS``
# alternates over
MATMUL_TARGETS = frozenset(
    f"aten.{op}.default" for op in ("mm", "addmm", "bmm", "baddbmm", "linear", "matmul")
)


def alternate_matmuls(blocks: list[Block], target_of) -> frozenset[str]:
    """The matmul nodes ``Recompute.HALF_MATMULS`` recomputes: of each block's matmuls
    (``MATMUL_TARGETS``; ``target_of(name)`` is a node's target as a string) in graph order, the
    2nd, 4th, 6th, ... (a Llama layer's k, o and up projections of its q, k, v, o, gate, up, down),
    as torchtitan's op-level selective checkpointing counts them (``_get_custom_policy`` in its
    ``activation_checkpoint.py``: a matmul's output is saved unless it is an even one of its
    block's). The pricing (``passes/trades.py``) and the runtime (``codegen/blocks.py``) both read
    this set, so they drop the same outputs."""
    out = []
    for b in blocks:
        mms = [v for v in b.nodes if target_of(v) in MATMUL_TARGETS]
        out += mms[1::2]
    return frozenset(out)
