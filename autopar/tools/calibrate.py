"""Calibrate a :class:`~autopar.cluster.ClusterSpec` from measurements on the machine that will run.

Method
------
Communication (``measure_collectives``): inside an initialized process group (any backend) every
rank runs each collective on a float32 tensor of each size, exactly as ``codegen/collectives.py``
runs it:

* ``all_reduce``: ``clone`` + ``dist.all_reduce`` (``B`` = the tensor's bytes);
* ``all_gather``: ``dist.all_gather`` into a list of ``n`` shards + ``torch.cat`` (``B`` = bytes of
  the gathered, full tensor; each rank contributes ``B / n``), as codegen gathers along any dim
  but 0 (along dim 0 it gathers straight into the output and skips the ``cat``'s copy, which is
  ``B / memory_bandwidth`` less than the fit says);
* ``reduce_scatter``: on gloo, ``all_reduce`` of the full tensor + a local slice (``B`` = the full
  tensor's bytes); on NCCL, ``dist.reduce_scatter_tensor``;
* ``all_reduce_queued``: ``QUEUE_DEPTH`` asynchronous in-place all-reduces issued back to back and
  then waited for, timed per call: what an overlapped gradient all-reduce costs behind another
  (``codegen/grad_sync.py``, ``cost_model/overlap.py``); fitted like ``all_reduce``.

The same again on the groups a mesh axis of the world can have (``group_layouts``: ``n`` ranks
``stride`` apart, e.g. pairs of neighbours and pairs two apart among 4 ranks), every group of a
layout at once as the axis runs them, each sample the slowest group's
(``measure_group_collectives``); fitted per collective, size range and layout
(``comm.group_ranges``): where ranks share cores, a small collective's time does not follow the
ring's ``(n-1)`` latency terms from one group size to another. These per-layout entries and
``all_reduce_queued`` serve CPU (gloo) ranks sharing a host's cores; no preset carries them.

A collective's time is what it adds to the wall time of a loop of steps (``measure_added``):
``BURST`` iterations of a fixed amount of compute (``REFERENCE_GAP_S`` of wall per iteration with
every rank computing, the pace the cost model prices compute at) then the collective, against
the same loop without it; a loop's wall from the first rank's start to the last rank's end
(``perf_counter`` is one clock on a host; ranks on several hosts take the slowest rank's own
loop time). Each repeat runs every loop after a barrier, in an order shuffled per repeat, and a
sample is the mean over ``repeats`` loops less the top and bottom 2.5% (``trimmed_mean``: a step
pays the expected time of each collective, stalls included). The wall, not the call's own time:
where ranks share cores, a rank that arrives early waits while the others compute on the core it
lent, which the compute's price holds already, and a rank that leaves first computes on a core
the others still need to finish the collective, which the call's own time does not see; a
loop's added cost is what a step's wall is made of (``benchmarks/bench_step_timeline.py``; how
far the call's own time and the added cost lay apart on the development machine:
``benchmarks/README.md``, "Readings of the development VM").

Fit (``autopar/tools/calibrate_fit.py``): the ring formulas of ``cost_model/comm.py``, in
relative least squares; ``calibrate`` fits one link to the all-reduce and all-gather samples
together, and one (bandwidth, latency) per collective and size range (``fit_ranges``).
Gloo's reduce-scatter is an all-reduce + slice, i.e. about twice what the reduce-scatter formula
says: its samples are left out of the one-line link but have their own ranges.

Compute (``autopar/tools/calibrate_compute.py``: per-op overhead, memory bandwidth,
FLOP/s, per-element times of transcendental pointwise ops), on as many ranks at once as the host
has cores while the others wait, in lockstep (each op timed while the other ranks run it too, as
in a step), ``COMPUTE_ROUNDS`` times spread over the calibration (before the collectives, after
them, after the sync wait), and each figure the median over those rounds and ranks (one round's
matmul rate varies from run to run on a shared host): the ranks of a step share the host's
memory bandwidth and caches, so a rank streams memory slower while another does than alone.
On CPUs the ranks of a node share its cores: ``calibrate`` records the cores this process may
use as ``HostContention.host_cores`` (``DeviceSpec.contention``) and the cost model prices
compute ``devices_per_node / host_cores`` times slower when there are more ranks than cores
(``ClusterSpec.compute_slowdown``; each rank computes on one thread, as ``autopar.launch`` sets it).

Sync wait (``measure_sync_wait``, ``cost_model/sync.py``), on every rank at once, on CPU ranks
(not on NCCL: accelerators share no cores and get no ``contention``): how much more a
collective of each kind adds to a loop of steps (wall time, with against without it) after more
compute since the previous one, stored as ``HostContention.sync_wait_kinds`` (and the largest
as ``HostContention.sync_wait``, for the kinds not measured).

Overlap (``autopar/tools/overlap.py:measure_overlap``), on every rank at once: how much of an
all-reduce issued asynchronously is hidden behind concurrent compute, stored as
``DeviceSpec.comm_overlap``.

``calibrate`` returns ``base`` with ``intra_node`` (and, on one node, ``inter_node``) replaced by
the fitted link and the device's ``peak_flops['float32']``, ``memory_bandwidth``,
``inplace_bandwidth``, ``matmul_dim_half``, ``matmul_overhead_s``, ``kernel_launch_s``,
``pointwise_s``, ``per_flop_s``, ``optimizer_param_s``, ``step_overhead_s`` and ``comm_overlap``
replaced by the measured values, and its ``contention`` by a ``HostContention`` of the measured
cores and sync waits on CPU ranks (None on NCCL); ``out_path`` saves it as JSON.
Figures a calibration gave on the development machine: ``benchmarks/README.md``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import socket
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar.cluster import ClusterSpec, DeviceKind, HostContention, LinkSpec, usable_cores
from autopar.cost_model.comm import group_ranges
from autopar.cost_model.sync import REFERENCE_GAP_S, SYNC_GAPS_S, SYNC_KINDS
from autopar.tools.calibrate_compute import (
    Lockstep,
    lockstep,
    measure_compute,
    median_compute,
    sync,
    trimmed_mean,
)
from autopar.tools.calibrate_fit import (
    KINDS,
    Sample,
    fit_errors,
    fit_link,
    fit_ranges,
    predict_time,
    ring_coefficients,
)
from autopar.tools.overlap import measure_overlap

__all__ = [
    "Sample",
    "Calibration",
    "KINDS",
    "DEFAULT_SIZES",
    "QUICK_SIZES",
    "ring_coefficients",
    "measure_collectives",
    "measure_added",
    "fit_link",
    "fit_ranges",
    "fit_errors",
    "predict_time",
    "measure_compute",
    "median_compute",
    "measure_sync_wait",
    "run_calibration",
    "calibrate",
]

QUEUE_DEPTH = 8  # all_reduce_queued: a burst of this many async all-reduces, priced per call
BURST = 3  # iterations of (compute + collective) per timed loop of measure_collectives
_SAME = object()  # measure_added's lockstep_group default: the group itself
_MIN_ADDED_S = 1e-6  # s: floor of a collective's measured cost (a loop's noise can exceed a fast one's)
LINK_KINDS = ("all_reduce", "all_gather")  # the samples calibrate() fits the link to
DEFAULT_SIZES = (2**10, 2**13, 2**16, 2**18, 2**20, 2**22, 2**24)  # bytes: 1 KiB .. 16 MiB
QUICK_SIZES = (2**10, 2**16, 2**20)
DEFAULT_REPEATS = 40
QUICK_REPEATS = 5
SYNC_LOOP_STEPS = 30  # iterations per timed loop of measure_sync_wait: ranks settle into a step's drift
SYNC_BYTES = 2**16  # bytes of each collective measure_sync_wait times: an activation's, small
COMPUTE_ROUNDS = 3  # rounds of compute figures, spread over a calibration (1 when quick)


# --------------------------------------------------------------------------------------------------
# communication
# --------------------------------------------------------------------------------------------------


def _collective_fn(
    kind: str, numel: int, n: int, rank: int, device: torch.device, group
) -> Callable[[], None]:
    full = torch.ones(numel, dtype=torch.float32, device=device)
    if kind == "all_reduce":

        def run() -> None:
            x = full.clone()
            dist.all_reduce(x, group=group)

    elif kind == "all_gather":
        shard = torch.ones(numel // n, dtype=torch.float32, device=device)

        def run() -> None:
            parts = [torch.empty_like(shard) for _ in range(n)]
            dist.all_gather(parts, shard, group=group)
            torch.cat(parts)

    elif kind == "reduce_scatter":
        nccl = dist.get_backend(group) == "nccl"

        def run() -> None:
            if nccl:
                out = torch.empty(numel // n, dtype=torch.float32, device=device)
                dist.reduce_scatter_tensor(out, full, group=group)
            else:  # as codegen/collectives.py on gloo: all-reduce + local slice
                x = full.clone()
                dist.all_reduce(x, group=group)
                x.chunk(n)[rank].contiguous()

    elif kind == "all_reduce_queued":  # as codegen/grad_sync.py: in place, async, back to back
        bufs = [full.clone() for _ in range(QUEUE_DEPTH)]

        def run() -> None:
            for w in [dist.all_reduce(b, group=group, async_op=True) for b in bufs]:
                w.wait()

    else:
        raise ValueError(f"unknown collective kind {kind!r}; known: {KINDS}")
    return run


def measure_collectives(
    sizes_bytes: Iterable[int] = DEFAULT_SIZES,
    kinds: Iterable[str] = KINDS,
    group=None,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = 3,
    gap_s: float = REFERENCE_GAP_S,
    lockstep_group=_SAME,
) -> list[Sample]:
    """Time each collective of ``kinds`` at each size (bytes of the full float32 tensor): what it
    adds to the wall time of a loop of steps, each ``gap_s`` of compute then the collective
    (``measure_added``; per call of a queued burst), at least ``_MIN_ADDED_S``.

    Call on every rank of ``group`` (default: the world) and of ``lockstep_group`` (default:
    ``group``; ``measure_added``). Every rank returns the same samples.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("measure_collectives needs an initialized torch.distributed process group")
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    device = _group_device(group)
    warm = torch.ones(1024, device=device)
    for _ in range(5):  # first collectives on a fresh group set up connections: not timed
        dist.all_reduce(warm, group=group)
        dist.barrier(group=group)
    cases: list[tuple[str, int]] = []
    runs: list[Callable[[], None]] = []
    for kind in kinds:
        for size in sizes_bytes:
            numel = max(n, int(size) // 4 // n * n)  # float32, divisible by n
            run = _collective_fn(kind, numel, n, rank, device, group)
            for _ in range(warmup):
                run()
            sync(device)
            cases.append((kind, numel * 4))
            runs.append(run)
    added = measure_added(runs, group=group, repeats=repeats, gap_s=gap_s, lockstep_group=lockstep_group)
    return [
        Sample(
            kind=kind,
            nbytes=nbytes,
            n=n,
            seconds=max(t, _MIN_ADDED_S) / (QUEUE_DEPTH if kind == "all_reduce_queued" else 1),
        )
        for t, (kind, nbytes) in zip(added, cases)
    ]


def measure_added(
    calls: Sequence[Callable[[], None]],
    group=None,
    repeats: int = DEFAULT_REPEATS,
    gap_s: float = REFERENCE_GAP_S,
    lockstep_group=_SAME,
) -> list[float]:
    """Seconds each of ``calls`` adds to a loop of steps, per iteration: on every rank of
    ``group``, ``repeats`` rounds, in an order shuffled per round (the same on every rank), each
    entry after a barrier, of a loop of ``BURST`` x (``gap_s`` of compute + the call) for every
    call and once without one; a loop's wall is from the first rank's start to the last rank's
    end where the ranks share a host's clock (else the slowest rank's own); an entry's figure is
    the mean of its walls less the top and bottom 2.5%, less the same of the loop without a call,
    over ``BURST`` (it can be negative by the loops' noise). Every rank returns the same list.

    ``lockstep_group`` (default: ``group``; ``None``: the world) holds ``group``: the ranks that
    start each loop together (its barrier) and whose walls count, as a mesh axis's groups run
    their collectives at once in a step and the step lasts until the last of them ends. Each
    group of a layout timed on its own barrier drifts from the others into other loops, and its
    figure with it (``benchmarks/README.md``, "Readings of the development VM")."""
    pace = group if lockstep_group is _SAME else lockstep_group  # its barriers and walls
    device = _group_device(group)
    entries: list[Callable[[], None] | None] = [*calls, None]  # the last: the loop without a call
    shared = _shared_clock(pace)
    work = _GapWork(device)

    def loop(ops: int, call: Callable[[], None] | None) -> tuple[float, float]:
        return work.loop(ops, call, BURST, pace)

    ops = _ops_for_gap(loop, gap_s, shared, pace, device)
    # repeats outer, entries inner, in an order shuffled per repeat: a burst of interference hits
    # one loop of many entries, and no entry always follows the same one
    starts = [[0.0] * repeats for _ in entries]  # [entry][repeat], this rank's perf_counter
    ends = [[0.0] * repeats for _ in entries]
    for r in range(repeats):
        order = list(range(len(entries)))
        random.Random(r).shuffle(order)
        for i in order:
            starts[i][r], ends[i][r] = loop(ops, entries[i])
    walls = _walls(starts, ends, shared, pace, device)
    bare = trimmed_mean(walls[-1]) / BURST
    return [trimmed_mean(w) / BURST - bare for w in walls[:-1]]


class _GapWork:
    """A fixed amount of compute per call (``ops`` small matmuls and tanh), the same on every rank:
    ranks drift and take turns on shared cores as a step's ops do, where a timed spin would not."""

    def __init__(self, device: torch.device):
        self.device = device
        self.a = torch.ones(64, 64, device=device)

    def __call__(self, ops: int) -> torch.Tensor:
        b = self.a
        for _ in range(ops):
            # + 1: the values settle near 0.92; without it they decay into denormals after ~200
            # ops, whose arithmetic runs many times slower on CPUs
            b = torch.tanh(b @ self.a * 0.01 + 1.0)
        return b

    def loop(
        self, ops: int, call: Callable[[], None] | None, iterations: int, group=None
    ) -> tuple[float, float]:
        """This rank's ``perf_counter`` at the start and the end of ``iterations`` x (``ops`` ops
        [+ ``call``]), started on a barrier of ``group``."""
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(iterations):
            self(ops)
            if call is not None:
                call()
        sync(self.device)
        return t0, time.perf_counter()


def _group_device(group=None) -> torch.device:
    """The device a rank of ``group`` runs collectives on: its current GPU on NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _walls(starts, ends, shared: bool, group, device) -> list[list[float]]:
    """Per loop, its wall time over the group: first start to last end on one clock, else the
    slowest rank's own."""
    t0 = torch.tensor(starts, dtype=torch.float64, device=device)
    t1 = torch.tensor(ends, dtype=torch.float64, device=device)
    if shared:
        dist.all_reduce(t0, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(t1, op=dist.ReduceOp.MAX, group=group)
        wall = t1 - t0
    else:
        wall = t1 - t0
        dist.all_reduce(wall, op=dist.ReduceOp.MAX, group=group)
    return wall.cpu().clamp_min(0.0).tolist()


def _ops_for_gap(loop, gap_s: float, shared: bool, group, device) -> int:
    """Ops of ``_GapWork`` whose loop without a collective takes ``gap_s`` of wall per iteration
    with every rank of ``group`` computing (the compute's pace as the cost model prices it, ranks
    that share cores taking turns): two rounds of scaling from a first guess, each the median of
    three loops."""
    ops = 8
    for _ in range(2):
        per_op = []
        for _ in range(3):
            t0, t1 = loop(ops, None)
            per_op.append(_walls([[t0]], [[t1]], shared, group, device)[0][0] / BURST / ops)
        ops = max(1, round(gap_s / statistics.median(per_op)))
    return ops


def group_layouts(world: int) -> list[tuple[int, int]]:
    """``(n, stride)`` of every group of two or more ranks, less than the whole world, that an
    axis of a device mesh of ``world`` ranks can have: ``n`` ranks ``stride`` apart, in blocks of
    ``n * stride`` consecutive ranks (row-major, as ``passes/solver.py`` and ``codegen`` lay
    meshes out), ``n * stride`` dividing ``world``."""
    return [
        (n, s)
        for n in range(2, world + 1)
        for s in range(1, world // n + 1)
        if world % (n * s) == 0 and (n, s) != (world, 1)
    ]


def group_ranks(world: int, n: int, stride: int) -> list[list[int]]:
    """The ranks of each group of layout ``(n, stride)`` (``group_layouts``), in rank order."""
    span = n * stride
    return [[b + j + i * stride for i in range(n)] for b in range(0, world, span) for j in range(stride)]


def measure_group_collectives(
    sizes_bytes: Iterable[int] = DEFAULT_SIZES,
    kinds: Iterable[str] = KINDS,
    repeats: int = DEFAULT_REPEATS,
) -> dict[tuple[int, int], list[Sample]]:
    """``measure_collectives`` on the groups of each layout of ``group_layouts`` of the world,
    every group of a layout at once and in lockstep (as a mesh axis runs them), each loop's wall
    over the world: the slowest group's. Call on every rank of the default group; every rank
    returns the same samples."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[tuple[int, int], list[Sample]] = {}
    for n, stride in group_layouts(world):
        mine = None
        for ranks in group_ranks(world, n, stride):  # every rank creates every group, in order
            g = dist.new_group(ranks)
            if rank in ranks:
                mine = g
        # every group's loops in lockstep with the others', walls over the world
        out[(n, stride)] = measure_collectives(
            sizes_bytes, kinds, group=mine, repeats=repeats, lockstep_group=None
        )
    return out


def _shared_clock(group=None) -> bool:
    """Whether every rank of ``group`` reads one ``perf_counter`` (CLOCK_MONOTONIC): the ranks
    share a host (by host name and boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return False  # no way to tell one host's clock from another's
    names: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, (socket.gethostname(), boot), group=group)
    return len(set(names)) == 1


def measure_sync_wait(
    group=None,
    repeats: int = 3,
    nbytes: int = SYNC_BYTES,
    steps: int = SYNC_LOOP_STEPS,
    collectives: Mapping[str, Callable[[], None]] | None = None,
) -> dict:
    """``HostContention.sync_wait_kinds`` (``cost_model/sync.py``): what a synchronizing collective of
    each kind adds to a loop of steps, against the compute between two of them.

    On every rank of ``group``, for each gap of ``SYNC_GAPS_S``: a loop of ``steps`` iterations of
    a fixed amount of compute (the same op count on every rank, so that ranks drift as a step's
    do), and the same loop with a collective after each compute: each kind of ``SYNC_KINDS`` on
    ``nbytes`` (as ``codegen/collectives.py`` runs it: on gloo a reduce-scatter is an all-reduce,
    and takes its figure; or the callables of ``collectives``, by name); ``repeats`` rounds over
    the gaps, in an order shuffled per round. Per gap, ``d`` is the loop without the collective, per
    iteration, at the pace the cost model prices compute: where ranks share cores, from the first
    rank's start to the last rank's end (they take turns on the cores: ``compute_slowdown``);
    where each has its own, the median rank's time (compute is calibrated as the median over
    ranks, so a slower rank's drift is part of the wait). A collective's cost is the loop with
    it, first start to last end, less ``d`` (medians over the repeats). Its kind's ``sync_wait``
    is the slope ``c`` of the line ``cost = a + c * sqrt(d)`` (``_sqrt_slope``: robust to one
    stalled loop).

    Walls, not the collective's own time: where ranks share cores, the ranks that finish their
    compute first wait in the collective while the others compute on the cores they lent, which
    a collective's own time counts and a step does not pay; and the ranks that leave a
    collective first compute on cores that the others still need to finish it, which a step pays
    and a collective's own time (after a barrier) does not see.

    Returns ``{"points": {kind: [(d, cost), ...]}, "sync_wait": {kind: c}}``."""
    n = dist.get_world_size(group)
    backend = dist.get_backend(group)
    device = _group_device(group)
    work = _GapWork(device)  # the same op count on every rank

    same_as = {}
    if collectives is None:
        numel = max(n, nbytes // 4 // n * n)
        rank = dist.get_rank(group)
        # gloo has no reduce-scatter: codegen runs an all-reduce (and a local slice), whose wait it is
        same_as = {"reduce_scatter": "all_reduce"} if backend != "nccl" else {}
        collectives = {
            k: _collective_fn(k, numel, n, rank, device, group) for k in SYNC_KINDS if k not in same_as
        }

    # the compute's pace as the cost model prices it: ranks that share cores, all of them together
    # (compute_slowdown); ranks with cores of their own, the median rank's (compute is calibrated
    # as the median over ranks), so that the wait also holds a slower rank's drift
    pace = 0 if _cores(backend, n) < n else 1  # loop()'s figure: all ranks' wall, or the median rank's

    def loop(iters: int, coll: Callable[[], None] | None) -> tuple[float, float]:
        """Seconds per iteration of ``steps`` x (``iters`` ops [+ ``coll``]): from the first
        rank's start to the last rank's end, and the median rank's own."""
        mine = torch.tensor(work.loop(iters, coll, steps, group), dtype=torch.float64, device=device)
        every = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(every, mine, group=group)
        starts, ends = zip(*(e.tolist() for e in every))
        own = statistics.median(e - s for s, e in zip(starts, ends))
        return (max(ends) - min(starts)) / steps, own / steps

    for coll in collectives.values():
        loop(2, coll)  # first calls: not timed
    unit_s = loop(20, None)[pace] / 20  # s per op, every rank computing
    ops = [max(1, round(gap / unit_s)) for gap in SYNC_GAPS_S]
    bare: list[list[float]] = [[] for _ in ops]
    synced: dict[str, list[list[float]]] = {kind: [[] for _ in ops] for kind in collectives}
    # repeats outer, gaps inner in an order shuffled per repeat (the same on every rank): a host's
    # pace drifts over the seconds this takes, and gaps timed in ascending order would turn that
    # drift into a slope; each gap's loops alternate without and with each kind
    for r in range(repeats):
        order = list(range(len(ops)))
        random.Random(r).shuffle(order)
        for i in order:
            bare[i].append(loop(ops[i], None)[pace])
            for kind, coll in collectives.items():
                synced[kind][i].append(loop(ops[i], coll)[0])
    points: dict[str, list[tuple[float, float]]] = {kind: [] for kind in collectives}
    for i in range(len(ops)):
        d = statistics.median(bare[i])
        for kind in collectives:
            points[kind].append((d, statistics.median(synced[kind][i]) - d))
    waits = {kind: _sqrt_slope(p) for kind, p in points.items()}
    return {"points": points, "sync_wait": waits | {k: waits[v] for k, v in same_as.items()}}


def _sqrt_slope(points: Sequence[tuple[float, float]]) -> float:
    """``c`` of the line ``cost = a + c * sqrt(d)`` through ``(d, cost)``, at least 0: the median of
    the slopes between every two points (Theil-Sen), which one stalled loop of six does not move
    as it moves a least-squares line (0 where every gap rounded to one op: a device too slow to
    have anything to fit)."""
    xy = [(math.sqrt(d), y) for d, y in points]
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(xy) for x2, y2 in xy[i + 1 :] if x2 != x1]
    return max(0.0, statistics.median(slopes)) if slopes else 0.0


# --------------------------------------------------------------------------------------------------
# compute
# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# calibrate
# --------------------------------------------------------------------------------------------------


@dataclass
class Calibration:
    """Everything one calibration measured and fitted; ``cluster`` is what ``calibrate`` returns."""

    cluster: ClusterSpec
    link: LinkSpec
    samples: list[Sample]
    errors: list[float]  # fit_errors(samples, link), per sample
    compute: dict
    per_kind: dict[str, LinkSpec] = field(default_factory=dict)  # each kind fitted alone
    # layout (n, stride) -> its samples (measure_group_collectives), priced by the link's
    # group_ranges entries
    group_samples: dict[tuple[int, int], list[Sample]] = field(default_factory=dict)

    def table(self) -> str:
        """Human-readable summary: fitted numbers and the per-size fit error."""
        c = self.compute
        lines = [
            f"link (all-reduce + all-gather fit): bandwidth {self.link.bandwidth / 1e9:.3f} GB/s, "
            f"latency {self.link.latency * 1e6:.1f} us",
        ]
        for kind, lk in self.per_kind.items():
            lines.append(
                f"  {kind:<15} alone: bandwidth {lk.bandwidth / 1e9:.3f} GB/s, latency {lk.latency * 1e6:.1f} us"
            )
        lines.append(
            f"device: matmul {c['flops_effective'] / 1e9:.2f} GFLOP/s effective "
            f"(peak_flops float32 = {c['peak_flops'] / 1e9:.2f} GFLOP/s = effective / EFF_MAX; "
            f"half of it at a smallest size of {c.get('matmul_dim_half', 0):g}; "
            f"{c.get('matmul_overhead_s', 0) * 1e6:.1f} us more per GEMM), "
            f"memory {c['memory_bandwidth'] / 1e9:.2f} GB/s (in place {c.get('inplace_bandwidth', 0) / 1e9:.2f}), "
            f"per-op {c['kernel_launch_s'] * 1e6:.2f} us"
            + (f" (a chain of one op: {c['launch_chain_s'] * 1e6:.2f} us)" if c.get("launch_chain_s") else "")
        )
        for key, title, scale in (
            ("per_flop_s", "per forward GFLOP, ms", 1e12),
            ("pointwise_s", "pointwise ns/element", 1e9),
        ):
            if c.get(key):
                ops = (
                    f"{k.removeprefix('aten.').split('.')[0]} {f * scale:.2f}/{b * scale:.2f}"
                    for k, (f, b) in c[key].items()
                )
                lines.append(f"  {title} (fwd/bwd): " + ", ".join(ops))
        if c.get("optimizer_param_s"):
            lines.append(
                f"  per step {c['step_overhead_s'] * 1e6:.1f} us; optimizer per parameter tensor: "
                + ", ".join(f"{k} {v * 1e6:.2f} us" for k, v in c["optimizer_param_s"].items())
            )
        w = c.get("sync_wait")
        for kind, points in (w or {}).get("points", {}).items():
            lines.append(
                f"sync wait: {kind} adds, to a loop of "
                + ", ".join(f"{d * 1e3:.2f} ms of compute, {t * 1e3:.2f} ms" for d, t in points)
                + f": sync_wait = {w['sync_wait'][kind]:.4f} s^0.5"
            )
        o = c.get("overlap")
        if o:
            lines.append(
                f"overlap: all-reduce of {o['nbytes'] / 2**20:.0f} MiB {o['t_comm'] * 1e3:.2f} ms, compute "
                f"{o['t_compute'] * 1e3:.2f} ms, both at once {o['t_both'] * 1e3:.2f} ms: "
                f"comm_overlap = {o['efficiency']:.2f}"
            )
        lines.append(f"{'kind':<15} {'n':>2} {'bytes':>10} {'measured':>12} {'fitted':>12} {'rel.err':>8}")
        for s, e in zip(self.samples, self.errors):
            used = "" if s.kind in LINK_KINDS else "  (not fitted)"
            lines.append(
                f"{s.kind:<15} {s.n:>2} {s.nbytes:>10d} {s.seconds * 1e6:>9.1f} us "
                f"{predict_time(s, self.link) * 1e6:>9.1f} us {e * 100:>7.1f}%{used}"
            )
        for (n, stride), mine in self.group_samples.items():
            lines.append(f"groups of {n} ranks {stride} apart, every group at once (the slowest group):")
            for s in mine:
                t = predict_time(s, self.link, group_ranges(s.kind, n, stride))
                lines.append(
                    f"{s.kind:<15} {s.n:>2} {s.nbytes:>10d} {s.seconds * 1e6:>9.1f} us "
                    f"{t * 1e6:>9.1f} us {(t - s.seconds) / s.seconds * 100:>7.1f}%"
                )
        return "\n".join(lines)


def group_lockstep(group, device: torch.device) -> Lockstep:
    """The ranks of ``group`` (None: the world) in lockstep (``calibrate_compute.lockstep``): a
    barrier, the largest count through an all-reduce, and a rank's end of its samples as an
    asynchronous all-reduce, complete once every rank has issued it."""

    def agree(n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())

    def finished() -> Callable[[], bool]:
        work = dist.all_reduce(torch.zeros(1, device=device), group=group, async_op=True)
        return work.is_completed

    return Lockstep(barrier=lambda: dist.barrier(group=group), agree=agree, finished=finished)


def _compute_round(device: torch.device, cores: int, group, quick: bool) -> list[dict]:
    """One ``measure_compute`` on each of the first ``cores`` ranks at once, in lockstep over
    ``group`` (those ranks; they share the host's memory and caches, as the ranks of a step do),
    the others waiting: ranks beyond the cores are priced by ClusterSpec.compute_slowdown
    (``HostContention.host_cores``, recorded for CPUs). Every rank gets every measuring rank's
    figures."""
    mine = None
    if dist.get_rank() < cores:
        with lockstep(group_lockstep(group, device)):
            mine = measure_compute(device, quick=quick)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return [c for c in every if c is not None]


def _cores(backend: str, world: int) -> int:
    """How many of ``world`` ranks compute at once on a core (or accelerator) of their own: all
    on NCCL, at most the cores this process may use on CPUs."""
    return world if backend == "nccl" else min(usable_cores(), world)


def _measure_rank(sizes: Sequence[int], kinds: Sequence[str], repeats: int, quick: bool) -> dict:
    backend = dist.get_backend()
    device = _group_device(None)
    world = dist.get_world_size()
    cores = _cores(backend, world)
    group = dist.new_group(list(range(cores))) if cores < world else None  # every rank creates it
    rounds = 1 if quick else COMPUTE_ROUNDS
    # compute rounds spread over the calibration, between the other measurements: a shared host's
    # pace drifts over seconds, and one round of ~1.5 s catches whatever spell it falls in
    figures = _compute_round(device, cores, group, quick)
    samples = measure_collectives(sizes, kinds, repeats=repeats)
    groups = measure_group_collectives(sizes, kinds, repeats=repeats)
    if rounds > 1:
        figures += _compute_round(device, cores, group, quick)
    overlap = measure_overlap(repeats=3 if quick else 7)  # every rank: an all-reduce under compute
    sync_wait = None  # a term of ranks that share a host's cores (HostContention): CPU ranks only
    if backend != "nccl":
        sync_wait = measure_sync_wait(repeats=1 if quick else 3, steps=10 if quick else SYNC_LOOP_STEPS)
    for _ in range(rounds - 2):
        figures += _compute_round(device, cores, group, quick)
    compute = median_compute(figures)
    return {
        "samples": samples,
        "group_samples": groups,
        "sync_wait": sync_wait,
        "compute": compute,
        "host_cores": None if backend == "nccl" else usable_cores(),
        "overlap": overlap,
        "kind": device.type,  # the torch device type measured on: the spec's DeviceSpec.kind
    }


def _rank_entry(rank: int, world: int, sizes, kinds, repeats, quick) -> dict:
    return _measure_rank(sizes, kinds, repeats, quick)


def run_calibration(
    world_size: int | None = None,
    base: ClusterSpec | None = None,
    out_path: str | os.PathLike | None = None,
    *,
    sizes_bytes: Sequence[int] | None = None,
    repeats: int | None = None,
    quick: bool = False,
) -> Calibration:
    """Measure, fit and build the calibrated ClusterSpec; see :func:`calibrate`."""
    sizes = tuple(sizes_bytes or (QUICK_SIZES if quick else DEFAULT_SIZES))
    reps = repeats or (QUICK_REPEATS if quick else DEFAULT_REPEATS)
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        results = [_measure_rank(sizes, KINDS, reps, quick)]
    else:
        world = world_size or 2
        if world < 2:
            raise ValueError(f"calibrate: world_size must be >= 2 to measure collectives, got {world}")
        from autopar.launch import run_on_ranks

        results = run_on_ranks(_rank_entry, world, sizes, KINDS, reps, quick)
    samples: list[Sample] = results[0]["samples"]
    compute = dict(results[0]["compute"])  # every rank holds the same median (_measure_rank)
    compute["overlap"] = results[0]["overlap"]
    compute["sync_wait"] = results[0]["sync_wait"]
    groups: dict[tuple[int, int], list[Sample]] = results[0]["group_samples"]
    link = dataclasses.replace(
        fit_link([s for s in samples if s.kind in LINK_KINDS]),
        ranges=fit_ranges(samples)
        + tuple(
            (group_ranges(kind, n, stride), up, bw, lat)
            for (n, stride), mine in groups.items()
            for kind, up, bw, lat in fit_ranges(mine)
        ),
    )
    per_kind = {k: fit_link(samples, k) for k in KINDS if any(s.kind == k for s in samples)}

    cluster = base or ClusterSpec.preset("cpu", devices_per_node=world)
    contention = None  # accelerators: nothing shared
    if results[0]["host_cores"] is not None:  # CPU ranks: they share the host's cores
        waits = results[0]["sync_wait"]["sync_wait"]
        contention = HostContention(
            host_cores=results[0]["host_cores"],
            # the kinds not measured (all-to-all, send/recv) wait as the slowest measured kind
            sync_wait=max(waits.values(), default=0.0),
            sync_wait_kinds=waits,
        )
    peak = dict(cluster.device.peak_flops)
    peak["float32"] = compute["peak_flops"]
    device = dataclasses.replace(
        cluster.device,
        peak_flops=peak,
        memory_bandwidth=compute["memory_bandwidth"],
        inplace_bandwidth=compute["inplace_bandwidth"],
        matmul_dim_half=compute["matmul_dim_half"],
        matmul_overhead_s=compute["matmul_overhead_s"],
        kernel_launch_s=compute["kernel_launch_s"],
        pointwise_s=compute["pointwise_s"],
        per_flop_s=compute["per_flop_s"],
        optimizer_param_s=compute["optimizer_param_s"],
        step_overhead_s=compute["step_overhead_s"],
        comm_overlap=results[0]["overlap"]["efficiency"],
        contention=contention,
        kind=DeviceKind.parse(results[0]["kind"], "calibrate: the device measured on"),
    )
    over = {"device": device, "intra_node": link}
    if cluster.nodes == 1:
        over["inter_node"] = link
    cluster = cluster.with_overrides(**over)
    if out_path is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        cluster.save(out_path)
    return Calibration(
        cluster=cluster,
        link=link,
        samples=samples,
        errors=fit_errors(samples, link),
        compute=compute,
        per_kind=per_kind,
        group_samples=groups,
    )


def calibrate(
    world_size: int | None = None,
    base: ClusterSpec | None = None,
    out_path: str | os.PathLike | None = None,
    *,
    sizes_bytes: Sequence[int] | None = None,
    repeats: int | None = None,
    quick: bool = False,
) -> ClusterSpec:
    """A ClusterSpec whose links and device are measured on this machine.

    Inside an initialized process group, call on every rank (measures that group). Otherwise runs
    on ``world_size`` (default 2) local gloo processes. ``base`` defaults to
    ``ClusterSpec.preset("cpu", devices_per_node=world_size)``; its ``intra_node`` (and, on one
    node, ``inter_node``) link and its device's float32 peak FLOP/s, memory bandwidth and
    ``kernel_launch_s`` are replaced by the measured values, its ``kind`` by the kind of device
    measured on (the CUDA device of an NCCL group, else the CPU). Saved as JSON to ``out_path``
    if given.
    """
    return run_calibration(
        world_size, base, out_path, sizes_bytes=sizes_bytes, repeats=repeats, quick=quick
    ).cluster
