"""Overlap of gradient all-reduces with backward compute: a two-stream timeline, in seconds.

Backward runs as a sequence of steps on the compute stream (each op's backward compute and the
collectives issued inline, which block it). After some steps, a parameter's gradient is complete
and its all-reduce is issued on the communication stream (``codegen/grad_sync.py``), which runs
one collective at a time, in issue order. Backward ends when both streams are done.

With step ``i`` taking ``c_i`` seconds and issuing all-reduces of ``r_ij`` seconds when it ends:

    ready_i   = c_1 + ... + c_i                                   (compute stream, no waiting)
    start_ij  = max(ready_i, end of the previous all-reduce)       (comm stream, FIFO)
    end       = max(ready_last, end of the last all-reduce)        (ideal two-stream end)
    serial    = sum(c) + sum(r)                                    (everything inline)
    hidden    = efficiency * (serial - end)                        [s]

``serial - end`` is what perfectly independent streams would hide. Real streams interfere: on a
GPU, the collective's kernels take SMs from the concurrent GEMMs; on a CPU, gloo's threads take
the cores the ranks compute on. ``efficiency`` (``DeviceSpec.comm_overlap``, in [0, 1]) is the
fraction of that ideal overlap a device realizes; ``autopar calibrate`` measures it
(``cost_model/calibrate.py:measure_overlap``: a compute loop alone, an all-reduce alone, and both
at once, ``efficiency = (t_compute + t_comm - t_both) / min(t_compute, t_comm)``).
"""

from __future__ import annotations

from collections.abc import Sequence


def two_stream_end(steps: Sequence[tuple[float, Sequence[float]]]) -> float:
    """End time of backward with ``steps`` = ``[(compute_s, [all-reduce s issued after it]), ...]``
    in execution order, on independent compute and communication streams."""
    ready = comm_free = 0.0
    for compute, issued in steps:
        ready += compute
        for r in issued:
            comm_free = max(comm_free, ready) + r
    return max(ready, comm_free)


def hidden_seconds(steps: Sequence[tuple[float, Sequence[float]]], efficiency: float) -> float:
    """Seconds of all-reduce time hidden behind compute: ``efficiency`` times the ideal overlap."""
    serial = sum(c for c, _ in steps) + sum(sum(r) for _, r in steps)
    return max(0.0, efficiency * (serial - two_stream_end(steps)))


def measure_overlap(nbytes: int = 4 * 2**20, repeats: int = 7) -> dict:
    """Measure ``efficiency`` on the live process group; call on every rank (collective).

    Times, each the slowest rank's, trimmed-mean over ``repeats``: an all-reduce of ``nbytes``
    alone (``t_comm``); a loop of 128x128 matmuls sized to take about as long, alone
    (``t_compute``); and both at once, the all-reduce started asynchronously before the loop and
    waited for after it, as ``codegen/grad_sync.py`` runs them (``t_both``). Returns the three
    times and ``efficiency = (t_compute + t_comm - t_both) / min(t_compute, t_comm)`` in [0, 1]."""
    import time

    import torch
    import torch.distributed as dist

    from autopar.cost_model.calibrate import trimmed_mean

    cuda = dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    buf = torch.ones(nbytes // 4, device=dev)
    a = torch.randn(128, 128, device=dev)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def compute(iters: int) -> None:
        x = a
        for _ in range(iters):
            x = torch.tanh(x @ a * 0.01)

    def slowest(fn) -> float:
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
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
    t_comm = trimmed_mean([slowest(lambda: dist.all_reduce(buf)) for _ in range(repeats)])
    t_one = trimmed_mean([slowest(lambda: compute(16)) for _ in range(repeats)]) / 16
    iters = max(1, round(t_comm / t_one))
    t_compute = trimmed_mean([slowest(lambda: compute(iters)) for _ in range(repeats)])
    t_both = trimmed_mean([slowest(both(iters)) for _ in range(repeats)])
    ideal = min(t_compute, t_comm)
    eff = (t_compute + t_comm - t_both) / ideal if ideal > 0 else 0.0
    return {
        "t_compute": t_compute,
        "t_comm": t_comm,
        "t_both": t_both,
        "nbytes": nbytes,
        "efficiency": min(1.0, max(0.0, eff)),
    }
