"""Where a step's CPU time goes: autopar's forced plan against PyTorch's own engine, per rank.

Builds both sides of one ``bench_vs_torch.py`` pair (same model, batch, optimizer, plan options)
on gloo ranks and, after warm-up steps, reports per rank (``--what``):

=======  =====================================================================================
parts    CPU time per step (``time.process_time``, interleaved blocks of 10 steps): all, inside
         the pipeline schedule's ``step`` (pipelined layouts), and the rest (the step's own work,
         the optimizer)
opt      CPU time of one optimizer step alone (every gradient set to a constant)
=======  =====================================================================================

CPU time moves less with the load of a shared machine than wall-clock time, though it still
moves; ``profile_vs_torch.py`` counts calls and ops, ``bench_vs_torch.py`` gives the step-time
ratios.

    .venv/bin/python benchmarks/time_parts_vs_torch.py --model llama --layout pp --what parts
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_vs_torch as bench  # noqa: E402

from autopar.launch import run_on_ranks  # noqa: E402


def _closure(fn, cls):
    """The ``cls`` instance a runner's step function closes over (its module, optimizer, schedule)."""
    for cell in fn.__closure__ or ():
        if isinstance(cell.cell_contents, cls):
            return cell.cell_contents
    return None


def _parts(sides: dict) -> dict:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    inside = dict.fromkeys(sides, 0.0)
    total = dict.fromkeys(sides, 0.0)
    for name, runner in sides.items():
        module = _closure(runner.step, torch.nn.Module)
        sched = getattr(module, "schedule", None) or _closure(runner.step, _PipelineSchedule)
        if sched is None:
            continue
        run = sched.step

        def timed(*a, _run=run, _name=name, **k):
            t0 = time.process_time()
            try:
                return _run(*a, **k)
            finally:
                inside[_name] += time.process_time() - t0

        sched.step = timed
    for block in range(10):
        for name in list(sides)[:: 1 if block % 2 else -1]:
            dist.barrier()
            t0 = time.process_time()
            for _ in range(10):
                sides[name].step()
            total[name] += time.process_time() - t0
    n = 100
    return {s: f"{total[s] / n * 1e3:.3f} ms, schedule {inside[s] / n * 1e3:.3f}, rest {(total[s] - inside[s]) / n * 1e3:.3f}" for s in sides}  # fmt: skip


def _opt(sides: dict) -> dict:
    opts = {name: _closure(r.step, torch.optim.Optimizer) for name, r in sides.items()}
    for opt in opts.values():
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.full_like(p, 1e-3)
    times = {name: [] for name in opts}
    for block in range(10):
        for name in list(opts)[:: 1 if block % 2 else -1]:
            t0 = time.process_time()
            for _ in range(100):
                opts[name].step()
            times[name].append((time.process_time() - t0) / 100 * 1e3)
    return {name: f"{statistics.median(t):.3f} ms" for name, t in times.items()}


def _rank(rank, world, key, path, cut, args):
    name, size, layout = key
    got = bench.compare_once(
        name, size, layout, world, path, args.optimizer, cut, args.schedule, args.micro_batches
    )
    if "na" in got:
        return {"na": got["na"]}
    sides = got["runners"]
    for runner in sides.values():
        for _ in range(3):
            runner.step()
    dist.barrier()
    return (_parts if args.what == "parts" else _opt)(sides)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--layout", default="pp", choices=bench.LAYOUTS)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--what", default="parts", choices=("parts", "opt"))
    ap.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    ap.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    ap.add_argument("--micro-batches", type=int, default=4)
    args = ap.parse_args()
    world = 1 if args.layout == "eager" else args.world
    with tempfile.TemporaryDirectory() as tmp:
        jobs, cells = bench.plan_jobs(
            [args.model], [args.size], [args.layout], world, args.optimizer, args.schedule, args.micro_batches, Path(tmp)
        )  # fmt: skip
        if not jobs:
            sys.exit(f"not planned: {cells}")
        key, path, cut = jobs[0]
        results = run_on_ranks(_rank, world, key, path, cut, args, timeout_s=900)
    for rank, res in enumerate(results):
        print(f"rank {rank}: {res}")


if __name__ == "__main__":
    main()
