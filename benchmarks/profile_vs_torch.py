"""Where a step's host time goes: autopar's forced plan against PyTorch's own runner, counted.

Wall-clock ratios on a shared, loaded machine are noisy (``bench_vs_torch.py``); counts are not.
For each model and layout (``bench_vs_torch.plan_jobs`` / ``compare_once``: the same plans,
references, weights and batch), on gloo ranks, each side runs ``--warmup`` steps and then one
step under ``cProfile`` and one under ``torch.profiler`` (CPU). Rank 0 prints, per side and step:
Python function calls, aten ops (every dispatched op, nested ones too), top-level aten ops, the
collectives, and the calls and ops that differ most between the two sides.

    .venv/bin/python benchmarks/profile_vs_torch.py --models llama,mlp --layouts ddp,zero2,zero3
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_vs_torch as B  # noqa: E402

from autopar.launch import PRELOAD_ENV, run_on_ranks  # noqa: E402

COLLECTIVES = ("all_reduce", "allreduce", "reduce_scatter", "all_gather", "allgather", "broadcast", "barrier")


def _calls(step) -> tuple[int, Counter]:
    """Python calls of one step, and per function (file:line name) the calls."""
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    st = pstats.Stats(prof)
    per = Counter()
    for (file, line, name), (_cc, nc, _tt, _ct, callers) in st.stats.items():
        key = f"{Path(file).name}:{line} {name}"
        per[key] += nc
        for (cfile, cline, cname), c in callers.items():  # "callee <- caller": who makes the calls
            per[f"{key} <- {Path(cfile).name}:{cline} {cname}"] += c[0] if isinstance(c, tuple) else c
    return sum(v for k, v in per.items() if " <- " not in k), per


def _ops(step) -> tuple[Counter, Counter]:
    """(every op event of one step by name, the top-level ones by name)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.events() if e.name != "ProfilerStep*"]
    allc = Counter(e.name for e in events)
    top = Counter(e.name for e in events if e.cpu_parent is None)
    return allc, top


def _rank(rank: int, world: int, jobs: list, optimizer: str, warmup: int, schedule: str, k: int, feed: str):
    out = {}
    for key, path, cut in jobs:
        name, size, layout = key
        got = B.compare_once(name, size, layout, world, path, optimizer, cut, schedule, k, feed)
        if "na" in got:
            out[key] = got
            continue
        res = {}
        for side, runner in got["runners"].items():
            for _ in range(warmup):
                runner.step()
            dist.barrier()
            n, per = _calls(runner.step)
            dist.barrier()
            allc, top = _ops(runner.step)
            res[side] = {"calls": n, "per": per, "ops": allc, "top": top}
        out[key] = res
    return out


def _show(key, res: dict, n: int) -> None:
    print(f"\n=== {' '.join(key)}")
    if "na" in res:
        print(res["na"])
        return
    a, r = res["autopar"], res["reference"]
    for side, s in (("autopar", a), ("reference", r)):
        coll = {k: v for k, v in s["ops"].items() if any(c in k.lower() for c in COLLECTIVES)}
        print(
            f"{side:9s}: python calls {s['calls']:6d}, aten ops {sum(s['ops'].values()):5d}, "
            f"top-level {sum(s['top'].values()):5d}, collectives {coll}"
        )
    for what in ("top", "ops", "per"):
        diff = Counter({k: v for k, v in a[what].items() if " <- " not in k})
        diff.subtract({k: v for k, v in r[what].items() if " <- " not in k})
        worst = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:n]
        print(f"  {what}: autopar - reference, largest differences:")
        for name, d in worst:
            if d:
                print(f"    {d:+5d}  {name}  (autopar {a[what][name]}, reference {r[what][name]})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--models", default="llama,mlp")
    ap.add_argument("--sizes", default="tiny")
    ap.add_argument("--layouts", default="ddp,zero2,zero3")
    ap.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--feed", choices=("slices", "whole"), default="slices", help="as bench_vs_torch.py's")
    ap.add_argument("--top", type=int, default=15, help="differences shown per count")
    ap.add_argument(
        "--dump",
        type=Path,
        help="write rank 0's counts per model, side and function here (JSON), to diff two runs",
    )
    args = ap.parse_args()
    os.environ.setdefault(PRELOAD_ENV, "transformers")
    names, sizes, layouts = (a.split(",") for a in (args.models, args.sizes, args.layouts))
    with tempfile.TemporaryDirectory() as tmp:
        jobs, cells = B.plan_jobs(names, sizes, layouts, args.world, args.optimizer, "1f1b", 4, Path(tmp))
        for key, why in cells.items():
            print(key, why)
        per_rank = run_on_ranks(
            _rank, args.world, jobs, args.optimizer, args.warmup, "1f1b", 4, args.feed, timeout_s=1800
        )
    for key, _, _ in jobs:
        _show(key, per_rank[0][key], args.top)
    if args.dump:
        dumped = {
            " ".join(key): {
                side: {w: dict(s[w]) for w in ("per", "ops")} for side, s in per_rank[0][key].items()
            }
            for key, _, _ in jobs
            if "na" not in per_rank[0][key]
        }
        args.dump.write_text(json.dumps(dumped, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
