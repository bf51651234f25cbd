"""Measure how much of a collective hides behind compute on the live process group: the
``comm_overlap`` efficiency ``cost_model/overlap.py`` prices the gradient buckets' timeline with
(``autopar calibrate`` runs it)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from autopar.tools.calibrate_compute import sync, trimmed_mean


def measure_overlap(nbytes: int = 4 * 2**20, repeats: int = 7) -> dict:
    """Measure ``efficiency`` on the live process group; call on every rank (collective).

    Times, each the slowest rank's, trimmed-mean over ``repeats``: an all-reduce of ``nbytes``
    alone (``t_comm``); a loop of 128x128 matmuls sized to take about as long, alone
    (``t_compute``); and both at once, the all-reduce started asynchronously before the loop and
    waited for after it, as ``codegen/grad_sync.py`` runs them (``t_both``). Returns the three
    times and ``efficiency = (t_compute + t_comm - t_both) / min(t_compute, t_comm)`` in [0, 1]."""
    cuda = dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    buf = torch.ones(nbytes // 4, device=dev)
    a = torch.randn(128, 128, device=dev)

    def compute(iters: int) -> None:
        x = a
        for _ in range(iters):
            x = torch.tanh(x @ a * 0.01 + 1.0)  # + 1: no decay into denormals

    def slowest(fn) -> float:
        dist.barrier()
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def both(iters: int):
        def run():
            work = dist.all_reduce(buf, async_op=True)
            compute(iters)
            work.wait()

        return run

    for _ in range(2):  # warm up both paths
        slowest(lambda: dist.all_reduce(buf))
        slowest(lambda: compute(8))
    t_comm = trimmed_mean([slowest(lambda: dist.all_reduce(buf)) for _ in range(repeats)], 0.1)
    t_one = trimmed_mean([slowest(lambda: compute(16)) for _ in range(repeats)], 0.1) / 16
    iters = max(1, round(t_comm / t_one))
    t_compute = trimmed_mean([slowest(lambda: compute(iters)) for _ in range(repeats)], 0.1)
    t_both = trimmed_mean([slowest(both(iters)) for _ in range(repeats)], 0.1)
    ideal = min(t_compute, t_comm)
    eff = (t_compute + t_comm - t_both) / ideal if ideal > 0 else 0.0
    return {
        "t_compute": t_compute,
        "t_comm": t_comm,
        "t_both": t_both,
        "nbytes": nbytes,
        "efficiency": min(1.0, max(0.0, eff)),
    }
