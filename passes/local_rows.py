"""The model on one rank's rows: what a data-parallel region (``passes/data_region.py``) runs.

The model is traced again on its first ``B / k`` rows (``trace_rows``: ``k = n``, the ranks; where
that traces another graph, as Hugging Face's code does on one row, the largest ``k`` dividing ``n``
that traces the same nodes, ``graph_signature``). Comparing the two traces says

* which dim of each value holds the batch's rows (``row_dims``): the dim ``k`` times smaller on
  fewer rows; a value of equal shape has none;
* which arguments the rows size (``localize``): an argument that differs between the traces must be
  ``k`` times the other, and a rank runs it divided by ``n`` (``arange(B * S * top_k)`` becomes
  ``arange(B * S * top_k / n)``); any other difference (a ``1 / B``) is no size, and the node
  cannot run so.

A node so localized keeps its (args, kwargs) on one rank's rows in ``node.meta[LOCAL_CALL]``, with
references to the whole batch's graph: the region's check runs them, and codegen emits them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.passes.micro_batch_check import first_rows
from autopar.passes.trace import TracedGraph, graph_signature, trace

# node.meta key: (ranks, (args, kwargs)) of the node on one rank's rows, node references those of
# the whole batch's graph (``localize``)
LOCAL_CALL = "autopar_local_call"
ODD = "odd"  # a value whose rows are on no one dim (``row_dims``)


@dataclass(frozen=True)
class Rows:
    """The model traced again on fewer rows, ``B / factor`` (the same graph as the whole batch's):
    what tells which dim of each value holds the rows and which arguments the rows size; ``parts``:
    the ranks the batch is split over (each runs ``B / parts`` rows)."""

    traced: TracedGraph
    factor: int
    parts: int


def trace_rows(
    model: torch.nn.Module,
    example_inputs,
    tg: TracedGraph,
    parts: int,
    rewrite: Callable[[TracedGraph], None] = lambda _tg: None,
) -> Rows | str:
    """The model traced on the first ``B / parts`` rows of every input (``rewrite`` applied, as the
    whole batch's graph was), or where that traces another graph (Hugging Face squeezes a batch of
    one row), on the first ``k * B / parts`` rows for the least ``k`` that divides ``parts`` and
    traces ``tg``'s graph; or why there is none."""
    leaves = [t for t in pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor)]
    batch = leaves[0].shape[0] if leaves and leaves[0].dim() else 0
    if not batch or batch % parts:
        return f"the batch does not split into {parts} equal parts"
    want = graph_signature(tg)
    for factor in (f for f in range(parts, 1, -1) if parts % f == 0):
        rows = first_rows(example_inputs, batch // factor)
        if rows is None:
            return "the inputs do not share one batch on dim 0"
        try:
            got = trace(model, rows)
            rewrite(got)
        except Exception as e:  # noqa: BLE001 - any failure: no region, the caller's error stands
            return f"tracing on {batch // factor} rows failed: {e}"
        if graph_signature(got) == want:
            return Rows(got, factor, parts)
    return f"the model traced on fewer rows than {batch} is another graph"


def tensors(node: fx.Node) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]


def row_dims(tg: TracedGraph, rows: Rows) -> dict[str, int | None | str]:
    """Per node of ``tg``: the dim of its value(s) that holds the batch's rows (``rows.factor`` times
    smaller in ``rows.traced``, and a multiple of ``rows.parts``), None where no dim does, ``ODD``
    where the rows are on no one dim (or the two traces differ)."""
    lnodes = {n.name: n for n in rows.traced.graph.nodes}
    out: dict[str, int | None | str] = {}
    for node in tg.graph.nodes:
        ln = lnodes.get(node.name)
        gv, lv = tensors(node), tensors(ln) if ln is not None else []
        if len(gv) != len(lv):
            out[node.name] = ODD
            continue
        found: set = set()
        for g, loc in zip(gv, lv):
            diff = [d for d in range(g.dim()) if g.dim() == loc.dim() and g.shape[d] != loc.shape[d]]
            if g.dim() != loc.dim() or len(diff) > 1:
                found.add(ODD)
            elif not diff:
                found.add(None)
            else:
                d, n = diff[0], int(g.shape[diff[0]])
                found.add(d if n == rows.factor * int(loc.shape[d]) and n % rows.parts == 0 else ODD)
        out[node.name] = found.pop() if len(found) == 1 else (None if not found else ODD)
    return out


def localize(tg: TracedGraph, rows: Rows, names) -> str | None:
    """Store in each node of ``names`` its (args, kwargs) on one rank's ``B / parts`` rows, with
    references to ``tg``'s nodes (``LOCAL_CALL``): its arguments in ``tg``, but where the traces on
    ``B`` and ``B / factor`` rows differ: there the number must be ``factor`` times the other
    (sized by the rows), and is divided by ``parts``. None, or why a node cannot be so localized."""
    gnodes = {n.name: n for n in tg.graph.nodes}
    lnodes = {n.name: n for n in rows.traced.graph.nodes}
    for name in names:
        node = gnodes[name]
        if LOCAL_CALL in node.meta and node.meta[LOCAL_CALL][0] == rows.parts:
            continue
        g_leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
        l_leaves, l_spec = pytree.tree_flatten((lnodes[name].args, lnodes[name].kwargs))
        if spec != l_spec:
            return f"{node.target} (node {name}) takes other arguments on fewer rows"
        out = []
        for g, loc in zip(g_leaves, l_leaves):
            if isinstance(g, fx.Node) or _same(g, loc):
                out.append(g)
                continue
            sized = type(g) is type(loc) and type(g) in (int, float) and g == loc * rows.factor
            if not sized:
                return f"{node.target} (node {name}) has an argument the rows do not size ({g} and {loc})"
            if isinstance(g, int) and g % rows.parts:
                return f"{node.target} (node {name}) has a size {g} that {rows.parts} ranks do not divide"
            out.append(g // rows.parts if isinstance(g, int) else g / rows.parts)
        node.meta[LOCAL_CALL] = (rows.parts, pytree.tree_unflatten(out, spec))
    return None


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return type(a) is type(b) and a == b


def local_call(node: fx.Node) -> tuple[tuple, dict]:
    """A region node's (args, kwargs) on one rank's rows (``localize``)."""
    return node.meta[LOCAL_CALL][1]
