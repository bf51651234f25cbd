"""Asynchronous gradient all-reduce of parameters, overlapped with the rest of backward.

For the parameters ``passes/grad_sync.py`` selects (every use needs the same pure "f"), the
generated graph has no "f"; instead each such parameter gets two hooks:

* a tensor hook, which sees the gradient ``g`` autograd is about to accumulate:

  - ``.grad`` is None (the usual step): lets ``g`` through and marks the parameter;
  - ``.grad`` already holds a value (zeroed rather than set to None, or gradient accumulation
    over micro-batches): starts the all-reduce on a copy of ``g`` and lets zeros through, so
    the reduced copy is added to ``.grad`` when it arrives: an accumulated gradient is never
    reduced twice;
  - this backward will not accumulate into ``.grad`` (``torch.autograd.grad``): all-reduces ``g``
    inline, exactly as the "f" would have;

* a post-accumulate-grad hook, which starts ``all_reduce(p.grad, async_op=True)`` for a marked
  parameter.

The first reduction started in a backward queues a callback that the autograd engine runs when
backward ends (as ``DistributedDataParallel`` does): it waits for every pending reduction (and
adds the copies), so ``loss.backward()`` returns with the same gradients as the inline version.

A parameter reduced over several mesh axes starts the first asynchronously and the others after
it completes (one process group per axis).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.autograd import Variable

from autopar.codegen import collectives as C


def _accumulates(acc) -> bool:
    """Will the running backward accumulate into ``.grad`` through ``acc`` (its AccumulateGrad)?"""
    try:
        return torch._C._will_engine_execute_node(acc)
    except RuntimeError:  # raised for leaves under torch.autograd.grad, which never accumulates
        return False


class GradSync:
    def __init__(self, params: Sequence[tuple[torch.nn.Parameter, tuple[int, ...]]]):
        self._axes = {id(p): axes for p, axes in params}
        self._marked: set[int] = set()
        self._pending: list[tuple[torch.nn.Parameter, torch.Tensor, object, tuple[int, ...], bool]] = []
        self._queued = False
        # each parameter's AccumulateGrad node, kept alive: the parameter holds it only weakly, and
        # a node rebuilt later would not be the one the engine runs
        self._accumulators = []
        for p, axes in params:
            acc = p.view_as(p).grad_fn.next_functions[0][0]
            self._accumulators.append(acc)
            p.register_hook(self._pre_hook(p, acc, axes))
            p.register_post_accumulate_grad_hook(self._post_hook)

    def _pre_hook(self, p: torch.nn.Parameter, acc, axes: tuple[int, ...]):
        def hook(g: torch.Tensor) -> torch.Tensor:
            if not _accumulates(acc):
                for a in axes:
                    g = C._all_reduce(g, a)
                return g
            if p.grad is None:
                self._marked.add(id(p))
                return g
            self._start(p, g.detach().clone(), add=True)
            return torch.zeros_like(g)

        return hook

    def _post_hook(self, p: torch.nn.Parameter) -> None:
        if id(p) in self._marked:
            self._marked.discard(id(p))
            self._start(p, p.grad, add=False)

    def _start(self, p: torch.nn.Parameter, grad: torch.Tensor, add: bool) -> None:
        axes = self._axes[id(p)]
        work = dist.all_reduce(grad, group=C._group(axes[0]), async_op=True)
        self._pending.append((p, grad, work, axes[1:], add))
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self.finish)

    def finish(self) -> None:
        """Wait for every reduction started in this backward (runs when backward ends)."""
        pending, self._pending, self._queued = self._pending, [], False
        for p, grad, work, rest, add in pending:
            work.wait()
            for a in rest:
                dist.all_reduce(grad, group=C._group(a))
            if add:
                p.grad.add_(grad)
