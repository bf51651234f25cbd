"""Leading dims merged only to run a row-wise op, put back as they were: the merge undone.

``torch.nn.MultiheadAttention`` ends with ``out.permute(2, 0, 1, 3).reshape(L * B, E)``, its
output projection on those rows, and ``.view(L, B, E)``. Merging ``L`` (outer) with the batch
``B`` (inner) makes the batch the inner factor of one dim, which a ``Shard`` cannot describe
(DTensor's ``_StridedShard``): a data-parallel plan would have to gather the batch there. A
row-wise op (``linear``, a unary elementwise op, dropout) does not care how many leading dims its
rows have, so ``reshape(x, [L * B, E]) -> ops -> view([L, B, E'])`` computes what
``reshape(x, [L, B, E]) -> ops -> view([L, B, E'])`` does: the first reshape keeps the leading
dims, each op's value gets them too, the last view is then a no-op the rules pass through.

The rewrite keeps every node and name (a plan's decisions read onto it), only the first
reshape's size changes; the traced values are recomputed on the graph's fake tensors.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

aten = torch.ops.aten
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
# ops that act on each row (the last dim) alike, whatever the leading dims
ROW_WISE = frozenset(
    [
        aten.linear.default, aten.dropout.default, aten.relu.default, aten.gelu.default,
        aten.silu.default, aten.tanh.default, aten.sigmoid.default, aten.clone.default,
        aten.contiguous.default, aten._to_copy.default, aten.to.dtype, aten.neg.default,
    ]
)  # fmt: skip


def _shape(node) -> tuple[int, ...] | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(int(d) for d in v.shape) if isinstance(v, torch.Tensor) else None


def _row_wise(node: fx.Node, rows_input: fx.Node) -> bool:
    """Is ``node`` row-wise in its first argument ``rows_input`` (its other tensor inputs, a
    linear's weight and bias, independent of the rows)?"""
    if node.op != "call_function" or node.target not in ROW_WISE or node.args[0] is not rows_input:
        return False
    others = [a for a in node.args[1:] if isinstance(a, fx.Node)] + [
        a for a in node.kwargs.values() if isinstance(a, fx.Node)
    ]
    return node.target is aten.linear.default or not others


def unmerge_row_reshapes(gm: fx.GraphModule, recompile: bool = True) -> int:
    """Undo every merge of leading dims that only a chain of row-wise ops sees before a view puts
    the same leading dims back (module docstring); return how many were undone.
    ``recompile=False``: the caller regenerates ``gm``'s code."""
    undone = 0
    for first in list(gm.graph.nodes):
        if first.op != "call_function" or first.target not in RESHAPES:
            continue
        src, out = _shape(first.args[0]), _shape(first)
        if src is None or out is None or len(out) != 2:
            continue
        # the leading dims of the source that the merged rows are: prod(src[:k]) == out[0]
        k = next((k for k in range(2, len(src)) if math.prod(src[:k]) == out[0]), None)
        if k is None or math.prod(src[k:]) != out[1]:
            continue
        lead = list(src[:k])
        chain, node = [], first
        while len(node.users) == 1:
            (user,) = node.users
            if _row_wise(user, node):
                chain.append(user)
                node = user
                continue
            if user.target in RESHAPES and list(_shape(user)[:k]) == lead and _shape(node)[0] == out[0]:
                break
            chain = None
            break
        else:
            chain = None
        if not chain:
            continue
        mode = detect_fake_mode([first.args[0].meta["val"]])
        if mode is None:
            continue
        before = first.args, {n: n.meta["val"] for n in (first, *chain)}
        first.args = (first.args[0], lead + [out[1]], *first.args[2:])
        try:
            with mode:
                for n in [first, *chain]:
                    args = [a.meta["val"] if isinstance(a, fx.Node) else a for a in n.args]
                    kwargs = {
                        key: (a.meta["val"] if isinstance(a, fx.Node) else a) for key, a in n.kwargs.items()
                    }
                    n.meta["val"] = n.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - e.g. a view the unmerged strides do not allow: left as traced
            first.args = before[0]
            for n, v in before[1].items():
                n.meta["val"] = v
            continue
        undone += 1
    if undone and recompile:
        gm.recompile()
    return undone
