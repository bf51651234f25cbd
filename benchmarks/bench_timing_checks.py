"""Real-timing checks of the measuring code, which tests/ checks with injected clocks
(tests/fake_clock.py): run here against the wall clock, where a busy machine is a result, not a
failure. Each check prints its figures and PASS/FAIL against its tolerance:

* profiler: ``OpProfiler``'s 192x192 matmul figures against a direct ``perf_counter`` timing of
  the same op (forward and forward+backward within 3x), backward about twice the forward;
* lockstep: on 2 ranks, rank 0 50 ms late and its op 10x slower: the timed samples start within
  20 ms of each other, and the fast rank calls its op until the slow rank's samples end;
* added: ``measure_added`` on 2 ranks: a 4 ms sleep before a barrier adds 3.5 ms .. barrier + 8 ms
  per iteration, whether every rank sleeps or only the last;
* sync_wait: ``measure_sync_wait`` on one rank with stand-ins that sleep ``c sqrt(gap)``: each
  fitted ``sync_wait`` within 0.75x .. 1.5x of ``c (steps - 1) / steps``;
* interleaved: ``time_interleaved`` on 2 ranks, steps that sleep 2 and 6 ms: figures within
  [2, 5) and [6, 10) ms;
* overlap: ``measure_overlap`` on 2 ranks: both at once between 0.7x the longer alone and 1.5x
  both in a row.

    .venv/bin/python benchmarks/bench_timing_checks.py [--only profiler,lockstep,added,sync_wait,interleaved,overlap]

Exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

CHECKS = ("profiler", "lockstep", "added", "sync_wait", "interleaved", "overlap")


def _direct_median(fn, n: int = 15) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def check_profiler() -> tuple[bool, str]:
    import tempfile
    from pathlib import Path

    from autopar.tools.profiler import OpProfiler, TensorSpec

    f32 = torch.float32
    with tempfile.TemporaryDirectory() as d:
        prof = OpProfiler(cache_path=Path(d) / "c.json", num_threads=1)
        a = TensorSpec((192, 192), f32, requires_grad=True)
        timing = prof.time_op(torch.ops.aten.mm.default, (a, a))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.rand(192, 192, requires_grad=True)
        w = torch.rand(192, 192, requires_grad=True)
        fwd = _direct_median(lambda: torch.mm(x, w))
        g = torch.rand(192, 192)
        step = _direct_median(lambda: torch.autograd.grad(torch.mm(x, w), (x, w), g))
    finally:
        torch.set_num_threads(before)
    ok = (
        timing.ok
        and timing.backward_s > 0
        and fwd / 3 < timing.forward_s < fwd * 3
        and step / 3 < timing.total_s < step * 3
        and 0.7 < timing.backward_s / timing.forward_s < 6
    )
    return ok, (
        f"profiler forward {timing.forward_s * 1e6:.1f} us (direct {fwd * 1e6:.1f}), "
        f"step {timing.total_s * 1e6:.1f} us (direct {step * 1e6:.1f})"
    )


def _lockstep_rank(rank, world):
    from autopar.tools.calibrate import group_lockstep
    from autopar.tools.calibrate_compute import _inner_for, lockstep, median_time

    cpu = torch.device("cpu")
    pause = 1e-3 if rank == 0 else 1e-4
    calls: list[float] = []

    def op():
        calls.append(time.perf_counter())
        time.sleep(pause)

    own = min(_inner_for(op, cpu) for _ in range(3))
    with lockstep(group_lockstep(None, cpu)):
        agreed = _inner_for(op, cpu)
        if rank == 0:
            time.sleep(0.05)
        calls.clear()
        median_time(op, cpu, repeats=3, inner=agreed)
        end = time.perf_counter()
    return own, agreed, calls[1], end - 1.5 * pause, calls[-1]


def check_lockstep() -> tuple[bool, str]:
    from autopar.launch import run_on_ranks

    (own0, agreed0, start0, end0, _), (own1, agreed1, start1, _, last1) = run_on_ranks(_lockstep_rank, 2)
    ok = own0 < own1 and agreed0 == agreed1 > own0 and abs(start0 - start1) < 0.02 and last1 > end0 - 0.005
    return ok, (
        f"lockstep counts {own0}/{own1} -> {agreed0}/{agreed1}, starts {abs(start0 - start1) * 1e3:.1f} ms "
        f"apart, fast rank's last call {(last1 - end0) * 1e3:+.1f} ms after the slow rank's samples"
    )


def _added_rank(rank: int, world: int):
    import torch.distributed as dist

    from autopar.tools.calibrate import measure_added

    def everyone_sleeps() -> None:
        time.sleep(0.004)
        dist.barrier()

    def the_last_sleeps() -> None:
        if rank == world - 1:
            time.sleep(0.004)
        dist.barrier()

    return measure_added([everyone_sleeps, the_last_sleeps, dist.barrier], repeats=8)


def check_added() -> tuple[bool, str]:
    from autopar.launch import run_on_ranks

    res = run_on_ranks(_added_rank, 2)
    everyone, the_last, barrier = res[0]
    ok = res[0] == res[1] and -0.001 < barrier < 0.003
    ok = ok and all(0.0035 < t < barrier + 0.008 for t in (everyone, the_last))
    return ok, (
        f"added: everyone sleeps {everyone * 1e3:.2f} ms, the last sleeps {the_last * 1e3:.2f} ms, "
        f"barrier {barrier * 1e3:.2f} ms (4 ms slept)"
    )


def check_sync_wait() -> tuple[bool, str]:
    import torch.distributed as dist

    from autopar.launch import free_port
    from autopar.tools.calibrate import measure_sync_wait

    cs, steps = {"slow": 0.24, "fast": 0.12}, 20

    def stand_in(c: float):
        last, calls = [0.0], [0]

        def run() -> None:
            now = time.perf_counter()
            if calls[0] % steps:
                time.sleep(c * math.sqrt(now - last[0]))  # blocks, as a collective waiting on peers
            calls[0] += 1
            last[0] = time.perf_counter()

        return run

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        got = measure_sync_wait(repeats=5, steps=steps, collectives={k: stand_in(c) for k, c in cs.items()})
    finally:
        dist.destroy_process_group()
    ratios = {k: got["sync_wait"][k] / (c * (steps - 1) / steps) for k, c in cs.items()}
    ok = (
        all(0.75 < r < 1.5 for r in ratios.values())
        and got["sync_wait"]["slow"] > 1.4 * got["sync_wait"]["fast"]
    )
    return ok, "sync_wait fitted / true: " + ", ".join(f"{k} {r:.2f}" for k, r in ratios.items())


def _interleaved_rank(rank: int, world: int):
    from autopar.tools.measure import time_interleaved

    def entry(seconds: float):
        return lambda: time.sleep(seconds)

    return time_interleaved({"a": entry(0.002), "b": entry(0.006)}, 4, warmup=1, steps_per_round=2)


def check_interleaved() -> tuple[bool, str]:
    from autopar.launch import run_on_ranks

    res = run_on_ranks(_interleaved_rank, 2)
    ok = all(0.002 <= t["a"] < 0.005 and 0.006 <= t["b"] < 0.010 for t in res)
    return ok, f"interleaved: a {res[0]['a'] * 1e3:.2f} ms (2 slept), b {res[0]['b'] * 1e3:.2f} ms (6 slept)"


def _overlap_rank(rank, world):
    from autopar.tools.overlap import measure_overlap

    return measure_overlap(nbytes=2**22, repeats=10)


def check_overlap() -> tuple[bool, str]:
    from autopar.launch import run_on_ranks

    res = run_on_ranks(_overlap_rank, 2)
    r = res[0]
    ok = all(
        0.7 * max(x["t_compute"], x["t_comm"]) <= x["t_both"] <= 1.5 * (x["t_compute"] + x["t_comm"])
        for x in res
    )
    return ok, (
        f"overlap: compute {r['t_compute'] * 1e3:.2f} ms, comm {r['t_comm'] * 1e3:.2f} ms, "
        f"both {r['t_both'] * 1e3:.2f} ms, efficiency {r['efficiency']:.2f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(CHECKS), help="comma-separated checks to run")
    args = ap.parse_args()
    failed = 0
    for name in args.only.split(","):
        ok, line = globals()[f"check_{name}"]()
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
