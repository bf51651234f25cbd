"""Run a function on N local gloo processes (used by ``autopar demo`` and the multi-process tests).

Each rank gets ``fn(rank, world_size, *args)`` inside an initialized gloo process group; the
return value of every rank comes back to the caller (it must be picklable). A rank that raises
fails the whole run with that rank's traceback; a run that exceeds ``timeout_s`` is killed.

Each rank computes on one thread, on a core of its own or, with more ranks than cores, on the
core it shares with the same ranks every step (``pin_to_core``), and keeps the memory it frees for
reuse (``keep_freed_memory``).
"""

from __future__ import annotations

import ctypes
import io
import logging
import os
import queue as pyqueue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.hardware import HOST_CORES_ENV

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's upper bound for M_MMAP_THRESHOLD on 64-bit hosts


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep the memory this process frees for its next allocations: no heap
    trim, and blocks up to 32 MiB from the heap rather than from their own mmap. PyTorch's CPU
    allocator has no cache, so otherwise every step's activations are returned to the OS and
    page-faulted back in (a share of each step's system time: ``benchmarks/README.md``,
    "Readings of the development VM"), an amount that drifts with glibc's dynamic thresholds
    (``mallopt(3)``: ``M_TRIM_THRESHOLD``, ``M_MMAP_THRESHOLD``). The caching
    allocators of GPU backends do the same for device memory. Returns False without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    )


def pin_to_core(local_rank: int) -> int | None:
    """Bind this process to one of the cores it may run on: core ``local_rank mod cores`` of its
    CPU affinity, so consecutive ranks (a mesh's last axis, the most tightly coupled groups) run
    on different cores, and with more ranks than cores the same ranks take turns on one core
    every step. Returns the core, or None where the affinity cannot be set (not Linux). The cores
    it chose from stay this process's ``usable_cores()`` (``ClusterSpec.local()``, the ``cpu``
    preset and ``autopar calibrate`` record them as the host's).

    As CPU launchers bind ranks (Intel's ``ipexrun``, MPI's ``--bind-to core``): unbound, the
    kernel moves ranks between cores as they block in collectives and wake, so the ranks that
    share a core change within a step, and each move starts on cold caches. Bound before the
    process group starts, so that gloo's threads run on the rank's core too. Step times bound
    and unbound: ``benchmarks/bench_pinning.py`` (its runs: ``benchmarks/README.md``)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
        core = cores[local_rank % len(cores)]
        os.sched_setaffinity(0, {core})
        os.environ[HOST_CORES_ENV] = str(len(cores))  # what the host's ranks share: usable_cores
    except (AttributeError, OSError):
        return None
    return core


# modules a rank process has imported before it starts: with the ``forkserver`` start method, one
# server process imports them once and forks every rank of every later run from it, where each
# spawned rank imported torch and autopar anew (seconds of CPU per rank, the most of a short run's
# time on a small host). More, comma-separated, in AUTOPAR_RANK_PRELOAD (the tests add the model
# families they run).
PRELOAD_ENV = "AUTOPAR_RANK_PRELOAD"
_PRELOAD = ("__main__", "torch", "torch.distributed", "autopar.api")


def _start_method() -> str:
    """``forkserver`` (preloaded: ``_PRELOAD``) where the platform has it, else ``spawn``. Never
    ``fork``: the caller may hold threads (gloo's, a solver's) that a forked child would inherit
    mid-operation."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    extra = tuple(m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip())
    # takes effect when the server starts (the first run); later calls change nothing
    mp.get_context("forkserver").set_forkserver_preload(list(_PRELOAD + extra))
    return "forkserver"


def _worker(
    rank: int,
    world: int,
    port: int,
    fn: Callable,
    args: tuple,
    queue,
    timeout_s: float,
    pin: bool,
    environ: dict[str, str],
) -> None:
    # the caller's environment as it is now (a forked rank has the server's, from its start), as a
    # spawned process would have it
    os.environ.clear()
    os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    keep_freed_memory()
    if pin:
        pin_to_core(rank)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        # ``None``: the port was taken between ``free_port`` and the store's bind (the parent
        # starts again on another); ``fn`` has not run anywhere, as no rank got past this call
        queue.put((rank, None if port_taken(e) else False, traceback.format_exc()))
        return
    try:
        result = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(result, buf)  # plain bytes: no shared-memory handles that die with this process
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.barrier()  # no rank tears gloo down while another still talks to it
            finally:
                dist.destroy_process_group()


class RankFailed(RuntimeError):
    pass


def port_taken(e: BaseException) -> bool:
    """Whether ``init_process_group`` failed because its TCP store's port is in use (c10d's
    "EADDRINUSE ... address already in use")."""
    text = str(e).lower()
    return "eaddrinuse" in text or "address already in use" in text


# ``free_port`` asks the OS for a free port and closes it; another process (a parallel test's
# ranks) can bind it before rank 0's store does: then the ranks start again on a new one
PORT_TRIES = 3


def _next_result(queue, processes, deadline: float):
    """The next rank's ``(rank, ok, value)``, or a message when a rank process died without one
    (killed, or failed before ``fn`` ran: e.g. ``fn`` not importable in a fresh interpreter) or
    the run passed its deadline."""
    while True:
        try:
            return queue.get(timeout=0.5)
        except pyqueue.Empty:
            pass
        dead = [(i, p.exitcode) for i, p in enumerate(processes) if p.exitcode not in (None, 0)]
        if dead:
            try:  # its report may have arrived just before it exited
                return queue.get(timeout=2.0)
            except pyqueue.Empty:
                i, code = dead[0]
                return (
                    f"rank {i} process exited with code {code} before reporting a result (is the "
                    "function importable from a fresh interpreter, i.e. defined at module level "
                    "in an importable module?)"
                )
        if time.monotonic() > deadline:
            return "timed out waiting for the ranks' results"


def run_on_ranks(
    fn: Callable, world_size: int, *args, timeout_s: float = 300.0, pin_cores: bool = True
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return every rank's
    result. ``pin_cores``: bind each rank to a core (``pin_to_core``). Where the port picked for
    the process group is taken before rank 0 binds it, the ranks start again on another (up to
    ``PORT_TRIES`` ports)."""
    for attempt in range(PORT_TRIES):
        try:
            return _run_once(fn, world_size, args, timeout_s, pin_cores)
        except _PortTaken as e:
            if attempt == PORT_TRIES - 1:
                raise RankFailed(f"the process group's port was taken {PORT_TRIES} times:\n{e}") from None
            log.warning("the process group's port was taken before rank 0 bound it: starting again")
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    pass


def _run_once(fn: Callable, world_size: int, args: tuple, timeout_s: float, pin_cores: bool) -> list:
    method = _start_method()
    queue = mp.get_context(method).Queue()
    port = free_port()
    procs = mp.start_processes(
        _worker,
        args=(world_size, port, fn, args, queue, timeout_s, pin_cores, dict(os.environ)),
        nprocs=world_size,
        join=False,
        start_method=method,
    )
    results: dict[int, object] = {}
    errors = []
    taken = False  # a rank reported its port taken (``_worker``)
    deadline = time.monotonic() + timeout_s + 60.0  # + spawn and import time
    for _ in range(world_size):
        got = _next_result(queue, procs.processes, deadline)
        if isinstance(got, str):  # a rank died without reporting, or the run timed out
            errors.append(got)
            break
        rank, ok, value = got
        if ok:
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append(f"rank {rank} failed:\n{value}")
            taken = ok is None
            break
    if errors:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
        for p in procs.processes:
            p.join(10.0)
        if taken:
            raise _PortTaken("\n".join(errors))
        raise RankFailed("\n".join(errors))
    # every rank has reported: a rank that then dies in gloo's teardown (a C++ thread destroyed
    # while joinable aborts the process, rarely) has lost nothing, so it is logged, not raised
    for i, p in enumerate(procs.processes):
        p.join(timeout_s)
        if p.is_alive():
            p.terminate()
            log.warning("rank %d reported its result but did not exit in %.0f s: terminated", i, timeout_s)
        elif p.exitcode != 0:
            log.warning("rank %d reported its result, then exited with code %s in teardown", i, p.exitcode)
    return [results[r] for r in range(world_size)]
