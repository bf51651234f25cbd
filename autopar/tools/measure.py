"""Measure what runs: live tensor bytes (peak) and step time of a training step, on any device.

``LiveTensorTracker`` is a TorchDispatchMode that sees every tensor an op returns (forward,
backward and optimizer alike), counts each storage once (views share it) and subtracts it when the
last tensor on it dies. Tensors that exist before tracking starts (parameters, buffers) are added
with ``add_existing``. On CUDA, ``torch.cuda.max_memory_allocated`` measures the same thing
including the caching allocator's rounding. Storages over memory torch did not allocate (not
resizable: a mapped file's pages, as the slices ``safetensors`` reads view, or a foreign buffer)
and tensors with no real storage (fake, functional: tracing inside the mode) are not counted.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorTracker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, int] = {}  # storage data_ptr -> live tensors on it
        self._size: dict[int, int] = {}

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.live -= self._size.pop(key)
            del self._refs[key]

    def _track(self, t: torch.Tensor) -> None:
        if isinstance(t, DTensor):  # FSDP2's sharded parameters: the local shard holds the bytes
            t = t._local_tensor
        if t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
            key = st.data_ptr()
        except RuntimeError:  # no real storage: a fake or functional tensor (tracing runs inside)
            return
        if not st.resizable():  # memory torch did not allocate: a mapped file, a foreign buffer
            return
        if key == 0:
            return
        if key not in self._refs:
            self._refs[key] = 0
            self._size[key] = st.nbytes()
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        weakref.finalize(t, self._release, key)

    def add_existing(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            self._track(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def peak_step_memory(module: torch.nn.Module, step: Callable[[], None]) -> int:
    """Peak live tensor bytes on this rank while ``step()`` runs (parameters and buffers included)."""
    tracker = LiveTensorTracker()
    tracker.add_existing(list(module.parameters()) + list(module.buffers()))
    tracker.add_existing(p.grad for p in module.parameters() if p.grad is not None)
    with tracker:
        step()
    return tracker.peak


def least_peak_step_memory(
    module: torch.nn.Module,
    step: Callable[[], None],
    steps: int = 3,
    barrier: Callable[[], None] | None = None,
) -> int:
    """The least of ``peak_step_memory`` over ``steps`` steps (each after ``barrier``, if given).

    A collective's backend may hold its tensors a little past the op that freed them (gloo's
    worker thread lets go of a finished work at its own pace): on a busy host a gathered input
    then and again outlives its last use into the next ops. The least of a few steps is the step's
    own peak, the one the cost model predicts (``cost_model/memory.py``)."""
    peaks = []
    for _ in range(steps):
        if barrier:
            barrier()
        peaks.append(peak_step_memory(module, step))
    return min(peaks)


def time_steps(
    step: Callable[[], None], warmup: int = 2, repeat: int = 5, barrier: Callable[[], None] | None = None
) -> float:
    """Median seconds of ``step()`` over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeat):
        if barrier:
            barrier()
        t0 = time.perf_counter()
        step()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_interleaved(
    steps: dict[str, Callable[[], None]],
    rounds: int,
    warmup: int = 2,
    steps_per_round: int = 1,
    settle: int = 1,
) -> dict[str, float]:
    """Seconds per step of each of ``steps`` (one per name), timed in interleaved rounds on every
    rank of the default process group (call on every rank): a slow spell of a shared machine hits
    every entry alike instead of whichever ran during it. A round runs the entries in an order
    shuffled per round (the same on every rank), each ``settle`` untimed steps and then, after a
    barrier, ``steps_per_round`` timed steps back to back; its time per step is the slowest
    rank's; each entry's figure is the median over ``rounds`` after ``warmup`` untimed rounds.

    The untimed steps and the order are for what a training loop sees, one entry over and over:
    the first step after another entry runs on the caches (and allocator state) that entry left,
    and a fixed order would charge that to the same entry every round (how much that moved one
    plan's figure on the development VM: benchmarks/README.md, "Readings of the development VM")."""
    import random

    import torch.distributed as dist

    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for r in range(warmup + rounds):
        random.Random(r).shuffle(order)
        for name in order:
            step = steps[name]
            for _ in range(settle):
                step()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps_per_round):
                step()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            t = torch.tensor([(time.perf_counter() - t0) / steps_per_round], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if r >= warmup:
                times[name].append(float(t.item()))
    return {name: statistics.median(v) for name, v in times.items()}
