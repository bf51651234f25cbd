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


def ring_hidden_s(comm_s: float, compute_s: float, n: int, efficiency: float) -> float:
    """Seconds a collective matmul hides of its collective (``kernels/collective_matmul.py``):
    the collective (``comm_s``, as ``CommModel.time`` prices it unfused) runs as ``n - 1`` ring
    hops of ``h = comm_s / (n - 1)`` each, beside the matmul's ``n`` chunks of ``m = compute_s / n``
    each. One chunk needs no hop (an all-gather's own piece, a reduce-scatter's first partial
    sum), and each other chunk's hop runs while the chunk before it computes, so the pair takes

        m + (n - 1) max(h, m)                                                            [s]

    against ``comm_s + compute_s = (n - 1) h + n m`` unfused: it saves

        hidden = efficiency * (n - 1) min(h, m) = efficiency * min(comm_s, (n - 1) / n * compute_s)

    What stays exposed is ``comm_s - hidden``: the part of the collective the matmul is too short
    to cover (``max(0, comm_s - (n - 1) / n * compute_s)`` at full efficiency), never less than
    nothing. ``efficiency`` (``DeviceSpec.comm_overlap``, in [0, 1]) is the fraction of ideal
    overlap the device realizes, as for the gradient buckets above. Not priced: the chunks'
    smaller GEMMs (``cost_model/compute.py``'s ``matmul_dim_half`` on ``m / n`` rows) and a hop's
    latency where the comm model prices a hierarchical or tree algorithm instead of the ring."""
    if n <= 1 or comm_s <= 0 or compute_s <= 0:
        return 0.0
    return efficiency * min(comm_s, (n - 1) / n * compute_s)


def gathers_ahead_exposed_s(gathers: Sequence[float], windows: Sequence[float], efficiency: float) -> float:
    """Seconds of parameter all-gathers started ahead of the compute that reads them that the step
    still waits for (ZeRO-1's gathers after the optimizer step, waited for bucket by bucket by
    the next forward: ``codegen/zero_one.py``, as Megatron-LM's ``--overlap-param-gather``).
    ``gathers[j]`` [s]: bucket ``j``'s all-gather, in the order the forward reads the buckets;
    ``windows[j]`` [s]: the compute stream's time from the first read of bucket ``j`` to that of
    bucket ``j + 1``. The gathers run back to back on the communication stream from time 0, and
    the compute reading bucket ``j`` starts once the bucket has landed and the compute before it
    is done:

        landed_j = g_0 + ... + g_j,       start_j = max(start_{j-1} + w_{j-1}, landed_j)
        ideal    = start_last + w_last - sum w        (the compute stream's waits)
        exposed  = sum g - efficiency * (sum g - ideal)                                       [s]

    The first bucket is always exposed; a bucket whose gather is shorter than the compute before
    it hides. ``efficiency`` (``DeviceSpec.comm_overlap``) is the fraction of the ideal overlap a
    device realizes, as for the gradient buckets above. The runtime keeps two buckets in flight
    (``zero_one.IN_FLIGHT``), not all: the link then idles only where the compute outruns it,
    where nothing is exposed anyway."""
    start = end = landed = 0.0
    for g, w in zip(gathers, windows):
        landed += g
        start = max(end, landed)
        end = start + w
    total = sum(gathers)
    ideal = end - sum(windows)
    return max(0.0, total - efficiency * max(0.0, total - ideal))
