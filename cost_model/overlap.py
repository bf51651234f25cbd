"""Overlap of gradient all-reduces with backward compute: a two-stream timeline, in seconds.

Backward runs as a sequence of steps on the compute stream (each op's backward compute and the
collectives issued inline, which block it). After some steps, a parameter's gradient is complete
and its all-reduce is issued on the communication stream (``codegen/grad_sync.py``), which runs
them in issue order. Backward ends when both streams are done.

Each all-reduce has two prices: ``t_iso``, issued on an idle stream (what an inline collective
costs, ``CommModel.time``), and ``t_q``, issued while the previous one is still in flight
(``CommModel.queued_all_reduce_time``): transports pipeline back-to-back collectives (gloo runs
two at once on its worker threads). ``t_q`` comes from a calibration (the link's
``all_reduce_queued`` ranges, which ``autopar calibrate`` fits; in practice for CPU ranks, whose
gloo queue it measures), else ``t_q = t_iso``: no preset has it. With step ``i`` taking ``c_i``
seconds:

    ready_i  = c_1 + ... + c_i                               (compute stream, no waiting)
    an all-reduce issued after step i, with the stream free at time ``free``:
        idle   (ready_i >= free): runs t_iso, ends ready_i + t_iso
        queued (ready_i <  free): runs t_q,   ends free + t_q
    end      = max(ready_last, end of the last all-reduce)    (ideal two-stream end)
    run      = sum of what the all-reduces ran (t_iso or t_q)
    hidden   = (sum t_iso - run) + efficiency * (sum c + run - end)           [s]

The first term is what queueing saves, on any device; the second, the compute overlap a device
realizes of the ideal one: real streams interfere (on a GPU, the collective's kernels take SMs
from concurrent GEMMs; on a CPU, gloo's threads take the cores the ranks compute on).
``efficiency`` (``DeviceSpec.comm_overlap``, in [0, 1]) is measured by ``autopar calibrate``
(:func:`measure_overlap`: a compute loop alone, an all-reduce alone, and both at once,
``efficiency = (t_compute + t_comm - t_both) / min(t_compute, t_comm)``). The step time is
the inline price (``sum c + sum t_iso``) minus ``hidden``.
"""

from __future__ import annotations

from collections.abc import Sequence

AllReduce = float | tuple[float, float]  # t_iso, or (t_iso, t_q)
Steps = Sequence[tuple[float, Sequence[AllReduce]]]


def _prices(r: AllReduce) -> tuple[float, float]:
    return (r, r) if isinstance(r, (int, float)) else (float(r[0]), float(r[1]))


def two_stream(steps: Steps) -> tuple[float, float]:
    """``(end, run)`` of backward with ``steps`` = ``[(compute_s, [all-reduces issued after it]),
    ...]`` in execution order, on independent compute and communication streams: the end time
    and the seconds the all-reduces ran (each at ``t_iso`` or, queued, ``t_q``)."""
    ready = free = run = 0.0
    for compute, issued in steps:
        ready += compute
        for r in issued:
            t_iso, t_q = _prices(r)
            t = t_iso if ready >= free else t_q
            free = max(free, ready) + t
            run += t
    return max(ready, free), run


def hidden_seconds(steps: Steps, efficiency: float) -> float:
    """Seconds the timeline saves against running every all-reduce inline at ``t_iso``."""
    end, run = two_stream(steps)
    compute = sum(c for c, _ in steps)
    iso = sum(_prices(r)[0] for _, issued in steps for r in issued)
    return max(0.0, (iso - run) + efficiency * (compute + run - end))


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

    from autopar.cost_model.calibrate import trimmed_mean  # calibrate imports this module
    from autopar.cost_model.calibrate_compute import sync

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
