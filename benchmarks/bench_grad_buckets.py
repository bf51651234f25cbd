"""Gradient buckets against one all-reduce per parameter: measured and predicted step time.

For each model, one data-parallel plan (``AxisRole.DATA``: every weight's gradient is
all-reduced after backward). Every rank builds it twice: with ``passes/grad_sync.BUCKET_BYTES`` at its default
(DistributedDataParallel's 25 MiB: one flat all-reduce per bucket) and at 1 byte (each parameter
its own bucket: one all-reduce per parameter). The two are timed
in interleaved rounds (the slowest rank's step, median over rounds), and each is priced on the
calibrated cluster with the same cap (``autopar.reprice``).

    .venv/bin/python benchmarks/bench_grad_buckets.py [--cluster cluster.json] [--world 2] [--rounds 15]
"""

from __future__ import annotations

import argparse

import torch

import autopar
from autopar.demo import train_step
from autopar.launch import run_on_ranks
from autopar.model_spec import load_model_spec
from autopar.passes import grad_sync
from autopar.tools.calibrate import run_calibration
from autopar.tools.measure import time_interleaved

MODELS = {
    "gpt2_tiny": "autopar.examples:gpt2_tiny(batch=8, seq=64, hidden=128, vocab=512)",
    "llama_tiny": "autopar.examples:llama_tiny(batch=8, seq=64, hidden=128, vocab=512)",
}
CAPS = {"per parameter": 1, "buckets": grad_sync.BUCKET_BYTES}
WARMUP = 2
STEPS_PER_ROUND = 4


def _rank(rank: int, world: int, spec: str, cluster_dict: dict, path: str, rounds: int) -> dict:
    cluster = autopar.ClusterSpec.from_dict(cluster_dict)
    runs = {}
    for name, cap in CAPS.items():
        grad_sync.BUCKET_BYTES = cap
        torch.manual_seed(0)
        model, inputs = load_model_spec(spec)
        pm = autopar.autoparallelize(model, cluster, inputs, plan=path)
        opt = torch.optim.SGD(pm.parameters(), lr=0.01)
        runs[name] = (pm.grad_sync.num_buckets, lambda m=pm, o=opt, x=inputs: train_step(m, o, x))  # noqa: E731
    times = time_interleaved({k: step for k, (_, step) in runs.items()}, rounds, WARMUP, STEPS_PER_ROUND)
    return {k: (runs[k][0], times[k]) for k in runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default=None, help="a calibrated spec file (default: calibrate now)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    cluster = (
        autopar.ClusterSpec.from_file(args.cluster) if args.cluster else run_calibration(args.world).cluster
    )
    cluster = cluster.with_overrides(nodes=1, devices_per_node=args.world)
    print(f"world {args.world}; step time, predicted and measured")
    print(f"{'model':<11} {'cap':<14} {'all-reduces':>11} {'pred ms':>8} {'meas ms':>8} {'err':>5}")
    for name, spec in MODELS.items():
        model, inputs = load_model_spec(spec)
        kw = dict(mesh_shape=(args.world,), optimizer=autopar.Optimizer.SGD)
        plan = autopar.plan(model, cluster, inputs, axis_roles=(autopar.AxisRole.DATA,), **kw)
        path = f"/tmp/bench_grad_buckets_{name}.json"
        plan.save(path)
        measured = run_on_ranks(_rank, args.world, spec, cluster.to_dict(), path, args.rounds)
        for cap_name, cap in CAPS.items():
            grad_sync.BUCKET_BYTES = cap
            pred = autopar.reprice(model, cluster, inputs, plan, optimizer=autopar.Optimizer.SGD).predicted
            n = measured[0][cap_name][0]
            t = max(r[cap_name][1] for r in measured)
            err = (pred.step_time_s - t) / t
            print(
                f"{name:<11} {cap_name:<14} {n:>11} {pred.step_time_s * 1e3:>8.2f} {t * 1e3:>8.2f} {err:>5.0%}",
                flush=True,
            )
        grad_sync.BUCKET_BYTES = CAPS["buckets"]


if __name__ == "__main__":
    main()
