"""Each micro-batch's share of a step's loss: the global batch's loss, whatever the micro-batches.

A step of ``k`` micro-batches (``ParallelModule.step``, ``PipelinedModule.step``) runs the graph on
each in turn; the graph's loss is that micro-batch's. The step's loss and gradients must be those
of the whole global batch, as one device computes them. A mean over equally many elements per
micro-batch (an MSE, a token mean with no label ignored) gives that as the plain mean of the ``k``
losses. A token mean whose ignored labels (``ignore_index``: padding, the unmasked positions of a
masked-LM batch) differ between micro-batches does not: micro-batch ``i`` counts ``c_i`` tokens,
and the global loss is ``sum_i c_i L_i / sum_i c_i``. So is a summed loss: ``sum_i L_i``.

``loss_weights(tg)`` reads which of these the graph's own loss is, off the traced graph of one
micro-batch:

* a cross-entropy or NLL loss (``aten.cross_entropy_loss``, ``aten.nll_loss*``, the fused
  ``autopar::linear_cross_entropy``) with ``reduction="mean"``, no class weights, whose labels the
  graph computes from its inputs alone (sliced, shifted, cast: nothing a parameter or the model
  computes): ``LossWeights.counts`` is a small program of those label ops, the ``!= ignore_index``
  test and a sum, run on each micro-batch's inputs before any forward, so that every backward
  already has its weight ``c_i / sum_j c_j`` (Megatron-LM's ``calculate_per_token_loss`` does the
  same for its micro-batches);
* the same with ``reduction="sum"``: every micro-batch weighs 1;
* anything else (an MSE, a classification mean over equally many rows, a loss the caller computes
  with ``loss_fn``): None, the plain mean, exact for equal-sized micro-batch means.

Where each rank is fed only its slice of the batch, its counts are of its rows: they are summed over
the data-parallel ranks (one all-reduce of ``k`` numbers per step), since the graph's loss of a
micro-batch is the mean over every rank's rows of it. Hand-written because no library reads a
traced graph's loss this way; the weighting itself is Megatron's.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.passes.trace import Role, TracedGraph

aten = torch.ops.aten

# casts and copies a returned loss may go through after its op
_PASS_THROUGH = {
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten._to_copy.default,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
}


def _losses() -> dict:
    """Loss op -> (label position, (ignore_index position, name, default), (reduction position, name,
    default), class-weight position or None): the ops whose reduction and ignored labels are read."""
    table = {
        aten.cross_entropy_loss.default: (1, (4, "ignore_index", -100), (3, "reduction", 1), 2),
        aten.nll_loss.default: (1, (4, "ignore_index", -100), (3, "reduction", 1), 2),
        aten.nll_loss_nd.default: (1, (4, "ignore_index", -100), (3, "reduction", 1), 2),
        aten.nll_loss_forward.default: (1, (4, "ignore_index", -100), (3, "reduction", 1), 2),
        aten.nll_loss2d_forward.default: (1, (4, "ignore_index", -100), (3, "reduction", 1), 2),
    }
    fused = getattr(torch.ops.autopar, "linear_cross_entropy", None)
    if fused is not None:
        table[fused.default] = (2, (3, "ignore_index", -100), (4, "reduction", "mean"), None)
    return table


def _arg(node: fx.Node, where: tuple):
    pos, name, default = where
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


@dataclass(frozen=True)
class LossWeights:
    """How a step weighs its micro-batches' losses (module docstring). ``counts``: a program of the
    graph's flat inputs returning the number of labels its loss counts (None: every micro-batch
    weighs 1, a summed loss)."""

    counts: fx.GraphModule | None

    def factors(self, parts: list[list], reduce=None) -> list[float]:
        """Per micro-batch (``parts``: each one's flat graph inputs), the factor its loss is
        multiplied by before the step divides the summed gradients by ``k``: ``k c_i / sum_j c_j``
        (1 each for a summed loss: ``k``). ``reduce``: sums a tensor of this rank's counts over the
        ranks whose rows make up each micro-batch (None: these are the whole micro-batches)."""
        k = len(parts)
        if self.counts is None:
            return [float(k)] * k
        return self.weigh(self.counted(parts, reduce))

    def counted(self, parts: list[list], reduce=None) -> torch.Tensor:
        """Per micro-batch (``parts`` and ``reduce`` as ``factors`` takes them), the labels its loss
        counts over the whole micro-batch (float64, on the host): what the graph's own count of
        that micro-batch, summed over the ranks, gives (``ParallelModule.step`` hands it to the
        forward, which then all-reduces no count). Only where ``counts`` is a program."""
        with torch.no_grad():
            c = torch.stack([self.counts(*flat).to(torch.float64).cpu() for flat in parts])
        return reduce(c) if reduce is not None else c

    @staticmethod
    def weigh(c: torch.Tensor) -> list[float]:
        """``factors`` from the micro-batches' counts ``c`` (``counted``)."""
        k = len(c)
        total = float(c.sum())
        if total == 0:  # nothing counted anywhere: the losses are NaN, as one device's; keep the mean
            return [1.0] * k
        return [k * float(x) / total for x in c]


def loss_weights(tg: TracedGraph) -> LossWeights | None:
    """The weighting of ``tg``'s loss (module docstring), or None for the plain mean."""
    out = next(n for n in tg.graph.nodes if n.op == "output")
    scalars = [
        leaf
        for leaf in pytree.tree_leaves(out.args[0])
        if isinstance(leaf, fx.Node)
        and isinstance(leaf.meta.get("val"), torch.Tensor)
        and leaf.meta["val"].dim() == 0
        and leaf.meta["val"].is_floating_point()
    ]
    if len(scalars) != 1:  # no loss, or several scalars: which is the loss is the caller's to say
        return None
    node = scalars[0]
    while node.op == "call_function" and node.target in _PASS_THROUGH:
        node = node.args[0]
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0:
        node = node.args[0]  # (loss, total_weight) / (loss, lse)
    spec = _losses().get(node.target) if node.op == "call_function" else None
    if spec is None:
        return None
    label_at, ignore_at, reduction_at, weight_at = spec
    if weight_at is not None and len(node.args) > weight_at and node.args[weight_at] is not None:
        return None  # class weights: the denominator is a sum of weights (not read here)
    if node.kwargs.get("weight") is not None:
        return None
    reduction = _arg(node, reduction_at)
    if reduction in (2, "sum"):
        return LossWeights(None)
    if reduction not in (1, "mean"):
        return None
    labels = node.args[label_at] if len(node.args) > label_at else node.kwargs.get("target")
    program = _count_program(tg, labels, _arg(node, ignore_at))
    return None if program is None else LossWeights(program)


def inputs_chain(node: fx.Node, is_input) -> list[fx.Node] | None:
    """The ops ``node`` is computed from, ``node`` last, each after what it reads, where those are
    ``call_function`` nodes on placeholders that ``is_input`` accepts alone (the labels sliced,
    shifted, cast: nothing a parameter or the model computes); None otherwise."""
    chain: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(n: fx.Node) -> bool:
        if n in seen:
            return True
        if n.op == "placeholder":
            return is_input(n)
        if n.op != "call_function" or not all(visit(i) for i in n.all_input_nodes):
            return False
        seen.add(n)
        chain.append(n)
        return True

    return chain if visit(node) else None


def _on_their_device(n: fx.Node) -> fx.Node:
    """A copied label op without its device move: the trace's device (``meta`` for a model built
    there, ``tests/test_weights.py``) is not the run's, and a count needs the labels where the
    caller put them. ``aten.to.device(x, device, dtype, ...)`` becomes ``aten.to.dtype(x, dtype,
    ...)``; a ``device=`` keyword is dropped."""
    if n.target is aten.to.device:
        n.target = aten.to.dtype
        n.args = (n.args[0], *n.args[2:])
    if "device" in n.kwargs:
        n.kwargs = {k: v for k, v in n.kwargs.items() if k != "device"}
    return n


def _count_program(tg: TracedGraph, labels, ignore_index) -> fx.GraphModule | None:
    """A graph of ``tg``'s flat inputs (its input placeholders, in order) that computes ``labels``
    as ``tg`` does and returns how many are not ``ignore_index``; None where the labels need
    anything but inputs."""
    if not isinstance(labels, fx.Node) or not isinstance(ignore_index, int):
        return None
    inputs = {p.name for p in tg.placeholders if p.role is Role.INPUT}
    chain = inputs_chain(labels, lambda n: n.name in inputs)
    if chain is None:
        return None
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in tg.graph.nodes:
        if n.op == "placeholder" and n.name in inputs:
            env[n] = g.placeholder(n.name)
    for n in chain:  # in the order they were reached: each after what it reads
        env[n] = _on_their_device(g.node_copy(n, lambda a: env[a]))
    counted = g.call_function(aten.ne.Scalar, (env[labels], ignore_index))
    g.output(g.call_function(aten.sum.default, (counted,)))
    return fx.GraphModule(torch.nn.Module(), g)
