"""Where one ``bench_moe.py`` row's planning time goes, in CPU seconds: on a VM whose cores other
jobs share, wall seconds measure the load; the search's own thread's CPU time is what an idle
machine's wall time tracks (its worker thread builds the next candidate's tables while HiGHS
solves, ``passes/prefetch.py``).

    .venv/bin/python benchmarks/profile_plan.py --row deepseek-v3-2048 [--cprofile 40]
    .venv/bin/python benchmarks/profile_plan.py --published llama3-405b-16384xh100-cp16

``--published NAME``: a ``bench_published.py`` row's own search (its plan's last column) instead.

Prints each progress line with its wall, process-CPU and search-thread-CPU seconds; then the
totals (and the load average), HiGHS's runs by kind (count, CPU of the calling thread, wall),
and the search thread's CPU in the stages that take most of it. The kinds: ``mip`` (the ILP),
``mip-bound`` (the ILP with the best plan so far as HiGHS's objective bound, where memory binds),
``lp`` / ``lp-ipm`` (the LP relaxation, dual simplex or interior point), ``fixed`` (a plan checked
against the rows: a rounding or a hint, ``solver._has_plan``), ``first`` (HiGHS's first solution
on the rows alone). ``--cprofile N``: the search thread under cProfile (its wall clock, slowed),
its N heaviest functions by cumulative time.

The counters wrap module functions for the run (nothing else changes), so the plan is the row's.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_moe  # noqa: E402

import autopar  # noqa: E402
from autopar import Float8, Outputs, Precision  # noqa: E402
from autopar.passes import lp_model  # noqa: E402

HIGHS: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0.0])  # kind -> [runs, cpu, wall]
PARTS: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])  # stage -> [calls, search-thread cpu]


def _count_highs() -> None:
    run = lp_model.Model._run_highs

    def counted(self, time_limit_s, relax=False, first=False, fixed=None, ipm=False, **kw):
        kind = (
            "first" if first else "fixed" if fixed else
            ("lp-ipm" if ipm else "lp") if relax else
            "mip-bound" if kw.get("objective_bound") is not None else "mip"
        )  # fmt: skip
        c, w = time.thread_time(), time.perf_counter()
        try:
            return run(self, time_limit_s, relax=relax, first=first, fixed=fixed, ipm=ipm, **kw)
        finally:
            got = HIGHS[kind]
            got[0] += 1
            got[1] += time.thread_time() - c
            got[2] += time.perf_counter() - w

    lp_model.Model._run_highs = counted


def _count(module, name: str, label: str) -> None:
    """``module.name`` timed in the search's thread (CPU seconds), under ``label``."""
    f = getattr(module, name)
    PARTS[label]  # listed in this order

    def timed(*a, **k):
        if threading.current_thread() is not threading.main_thread():
            return f(*a, **k)
        c = time.thread_time()
        try:
            return f(*a, **k)
        finally:
            got = PARTS[label]
            got[0] += 1
            got[1] += time.thread_time() - c

    setattr(module, name, timed)


def _count_parts() -> None:
    from autopar.passes import ladder, mesh_solve, rungs, search

    _count(search, "trace_stage", "trace")
    _count(search, "spmd_climb", "SPMD candidates' climbs")
    _count(search, "pipeline_climb", "pipeline candidates' climbs")
    _count(mesh_solve, "solve", "... ILP solves (HiGHS and building the ILPs)")
    _count(mesh_solve, "grad_sync_cost", "... gradient sync of the solutions (SPMD)")
    _count(mesh_solve, "fold_followers", "... followers folded (bound and ILP tables)")
    _count(ladder, "_bound", "... memory lower bound per rung")
    _count(rungs, "apply_trades", "... traded tables (pipeline rungs)")
    _count(rungs, "stage_tables", "... stage rows (pipeline rungs)")
    _count(rungs, "price_pipeline", "... pipeline schedules priced")
    _count(search, "price_stage", "price the plan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", default="deepseek-v3-2048", help="a bench_moe.py row name")
    ap.add_argument(
        "--published", default=None, metavar="NAME",
        help="a bench_published.py row instead: the search's own plan for it (its last column)",
    )  # fmt: skip
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--cprofile", type=int, default=0, help="print the N heaviest functions (cProfile)")
    args = ap.parse_args()
    _count_highs()
    _count_parts()
    if args.published:
        import bench_published

        run = bench_published.BY_NAME[args.published]
        model, inputs = bench_published.build(run)
        cluster = autopar.ClusterSpec.parse(run.cluster)
        options = dict(outputs=Outputs.LOSS, precision=bench_published.precision(run), float8=run.float8)
    else:
        make, preset, nodes, batch, *told = bench_moe.ROWS[args.row]
        cls, cfg = make()
        with torch.device("meta"):
            model = cls(cfg)
        ids = torch.zeros(batch, args.seq, dtype=torch.long, device="meta")
        inputs = {"input_ids": ids, "labels": ids}
        cluster = autopar.ClusterSpec.preset(preset, nodes, 8)
        options = dict(
            outputs=Outputs.LOSS, precision=Precision.BF16, float8=Float8.OFF, **(told[0] if told else {})
        )
    load0 = os.getloadavg()
    w0, p0, t0 = time.perf_counter(), time.process_time(), time.thread_time()

    def progress(line: str) -> None:
        print(
            f"[{time.perf_counter() - w0:6.1f} s wall {time.process_time() - p0:6.1f} s cpu "
            f"{time.thread_time() - t0:6.1f} s search] {line}",
            flush=True,
        )

    prof = cProfile.Profile() if args.cprofile else None
    if prof:
        prof.enable()
    plan = autopar.plan(model, cluster, inputs, progress=progress, **options)
    if prof:
        prof.disable()
    wall, cpu, own = time.perf_counter() - w0, time.process_time() - p0, time.thread_time() - t0
    pp = plan.pipeline.stages if plan.pipeline is not None else 1
    print(
        f"\nplan: mesh {plan.mesh_shape}, {pp} stages, {plan.trades.describe()}, step "
        f"{plan.predicted.step_time_s * 1e3:.0f} ms, peak {plan.predicted.peak_memory_bytes / 2**30:.1f} GiB"
    )
    print(
        f"planning: {wall:.1f} s wall, {cpu:.1f} s CPU (all threads), {own:.1f} s CPU in the search's "
        f"thread; load average {load0[0]:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print("\n| HiGHS run | count | CPU [s] | wall [s] |\n|---|---|---|---|")
    for kind, (n, c, w) in sorted(HIGHS.items(), key=lambda kv: -kv[1][1]):
        print(f"| {kind} | {n} | {c:.1f} | {w:.1f} |")
    n, c, w = (sum(v[i] for v in HIGHS.values()) for i in range(3))
    print(f"| all | {n} | {c:.1f} | {w:.1f} |")
    print("\n| search thread | calls | CPU [s] |\n|---|---|---|")
    for label, (n, c) in PARTS.items():
        print(f"| {label} | {n} | {c:.1f} |")
    if prof:
        pstats.Stats(prof).sort_stats("cumtime").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
