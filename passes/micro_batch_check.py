"""Which micro-batch counts keep the model the one-device model (the search's filter).

Micro-batches (gradient accumulation, and every pipeline) run the model on ``B / k`` rows at a
time. That is the same training step only if

* no op computes statistics over the batch: a training ``batch_norm`` normalizes each micro-batch
  with its own mean and variance (and counts micro-batches in ``num_batches_tracked``), so its
  step is not the one-device step on the whole batch; and
* the model's code does not change with the batch size: the generated module is traced again on
  one micro-batch and must be the plan's graph (``codegen/micro_batches.py:check_same_graph``).
  Hugging Face code takes other paths for one row (squeezes, ``if batch_size == 1``), found here
  by tracing the model on one row, once per search, only when the plan the search picks runs
  one-row micro-batches (the search then runs again without them, ``passes/search.py``).

A micro-batch count the user forces is honoured (they chose it; a batch-norm model is warned about).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.passes.rules.nn import batch_norm_training
from autopar.passes.trace import TracedGraph, graph_signature, trace

log = logging.getLogger(__name__)
aten = torch.ops.aten


def batch_statistics_op(gm: fx.GraphModule) -> str | None:
    """The first op of ``gm`` that computes statistics over its batch in training (a
    ``batch_norm`` with ``training=True``), as ``name (target)``; None if there is none."""
    for node in gm.graph.nodes:
        if batch_norm_training(node):
            return f"{node.name} ({node.target})"
    return None


def first_rows(inputs, rows: int):
    """``inputs`` (a tensor, tuple or dict) with every tensor leaf cut to its first ``rows`` rows,
    or None where the tensor leaves do not share one batch on dim 0."""
    leaves = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    if not leaves or any(t.dim() == 0 for t in leaves) or len({t.shape[0] for t in leaves}) > 1:
        return None
    return pytree.tree_map_only(torch.Tensor, lambda t: t[:rows], inputs)


class MicroBatchCheck:
    """``allows(batch, k)``: may the search plan ``k`` micro-batches of ``batch`` rows? The
    reasons it refused are in ``refused`` (k -> why), for the search's log and error messages.
    ``signature``: the plan's graph as traced (before fusion), ``graph_signature``."""

    def __init__(
        self,
        model: torch.nn.Module,
        example_inputs,
        tg: TracedGraph,
        forced: int | None,
        progress: Callable[[str], None] = lambda _msg: None,
    ):
        self.model, self.inputs, self.forced, self.say = model, example_inputs, forced, progress
        self.signature = graph_signature(tg)
        self.statistics = batch_statistics_op(tg.graph_module)
        self.refused: dict[int, str] = {}
        self._rows_ok: dict[int, bool] = {}
        if forced is not None and forced > 1 and self.statistics:
            log.warning(
                "micro_batches=%d with %s: each micro-batch is normalized with its own statistics, "
                "unlike the one-device step on the whole batch",
                forced,
                self.statistics,
            )

    def allows(self, batch: int | None, k: int, trace: bool = True) -> bool:
        """``trace=False``: the cheap checks only (the search's loops), and what tracing on one
        row already found; a one-row count not yet traced is then checked, by tracing, on the plan
        the search picks (``trace=True``)."""
        if k == 1 or (self.forced is not None and k == self.forced):
            return True
        if k in self.refused:
            return False
        one_row = batch is not None and batch // k == 1
        if self.statistics:
            self.refused[k] = f"{self.statistics} computes statistics over the batch"
        elif one_row and (trace or 1 in self._rows_ok) and not self._one_row_traces_alike():
            self.refused[k] = "the model's code takes another path for a batch of one row"
        if k in self.refused:
            self.say(f"micro-batches: {k} refused: {self.refused[k]}")
            return False
        return True

    def _one_row_traces_alike(self) -> bool:
        if 1 not in self._rows_ok:
            one = first_rows(self.inputs, 1)
            try:
                ok = one is not None and graph_signature(trace(self.model, one)) == self.signature
            except Exception as e:  # noqa: BLE001 - a model that does not trace on one row
                log.info("tracing on one row failed (%s): one-row micro-batches refused", e)
                ok = False
            self._rows_ok[1] = ok
        return self._rows_ok[1]
