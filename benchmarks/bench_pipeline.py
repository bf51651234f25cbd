"""Pipelined plans on CPU ranks: measured step time against predicted, and against the same model
kept whole on every rank.

Per configuration, one plan (``autopar.plan`` with the pipeline stages, schedule and micro-batches
forced; the first row the search's own plan with ``pipeline_stages=1``), built on every rank with
``autoparallelize(..., plan=...)``, trained with ``pmodel.step`` and an SGD step, timed in
interleaved rounds (the slowest rank's step, median over rounds,
``autopar.tools.measure.time_interleaved``). The predicted step is the plan's on the cluster given
(``--cluster``, a calibrated spec from ``autopar calibrate``; else the ``cpu`` preset).

The slope of the measured GPipe steps in the micro-batch count, against the predicted slope,
says what a micro-batch costs that the prediction leaves out: per micro-batch each rank runs one
forward and one backward action of its chunk (``passes/pipeline.py:PIPELINE_ACTION_S`` each).

    .venv/bin/python benchmarks/bench_pipeline.py [--cluster cluster.json] [--rounds 9]

Figures, with the machine and the command, are recorded in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import platform

import torch

import autopar
from autopar.launch import run_on_ranks
from autopar.model_spec import load_model_spec
from autopar.tools.measure import time_interleaved

SPEC = "autopar.examples:gpt2_tiny(batch=16, seq=64, hidden=128, vocab=512, layers=4)"
WORLD = 2
# name -> search options (None: the search's own plan without stages)
CONFIGS = {
    "no pipeline (search)": dict(pipeline_stages=1),
    "PP2 gpipe k=2": dict(pipeline_stages=2, schedule="gpipe", micro_batches=2),
    "PP2 gpipe k=4": dict(pipeline_stages=2, schedule="gpipe", micro_batches=4),
    "PP2 gpipe k=8": dict(pipeline_stages=2, schedule="gpipe", micro_batches=8),
    "PP2 1f1b k=4": dict(pipeline_stages=2, schedule="1f1b", micro_batches=4),
    "PP2 1f1b k=8": dict(pipeline_stages=2, schedule="1f1b", micro_batches=8),
}


def _rank(rank: int, world: int, plans: dict, cluster_dict: dict, rounds: int) -> dict:
    cluster = autopar.ClusterSpec.from_dict(cluster_dict)
    steps = {}
    for name, path in plans.items():
        torch.manual_seed(0)
        model, inputs = load_model_spec(SPEC)
        pmodel = autopar.autoparallelize(model, cluster, inputs, plan=path)
        opt = torch.optim.SGD(pmodel.parameters(), lr=0.01)

        def step(pmodel=pmodel, opt=opt, inputs=inputs):
            opt.zero_grad(set_to_none=True)
            pmodel.step(**inputs)
            opt.step()

        steps[name] = step
    return time_interleaved(steps, rounds=rounds, steps_per_round=3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", help="a calibrated cluster spec (JSON); default: the cpu preset")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default="/tmp/autopar_bench_pipeline")
    args = ap.parse_args()
    cluster = (
        autopar.ClusterSpec.from_file(args.cluster)
        if args.cluster
        else autopar.ClusterSpec.preset("cpu", devices_per_node=WORLD)
    )
    print(
        f"# {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, {SPEC}"
    )
    import pathlib

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plans, predicted, described = {}, {}, {}
    for name, options in CONFIGS.items():
        torch.manual_seed(0)
        model, inputs = load_model_spec(SPEC)
        mesh = {} if options.get("pipeline_stages", 1) == 1 else dict(mesh_shape=(1,))
        plan = autopar.plan(model, cluster, inputs, optimizer=autopar.Optimizer.SGD, **options, **mesh)
        path = out / f"{len(plans)}.json"
        plan.save(path)
        plans[name] = str(path)
        predicted[name] = plan.predicted.step_time_s
        described[name] = (
            f"mesh {tuple(plan.mesh_shape)} x {plan.pipeline.describe()}, {plan.trades.micro_batches} micro-batches"
        )
    measured = run_on_ranks(_rank, WORLD, plans, cluster.to_dict(), args.rounds, timeout_s=1800)[0]
    for name in CONFIGS:
        p, m = predicted[name], measured[name]
        print(
            f"{name:22s} {described[name]:48s} measured {m * 1e3:8.2f} ms, predicted {p * 1e3:8.2f} ms ({p / m - 1:+.1%})"
        )
    ks = [2, 4, 8]
    names = [f"PP2 gpipe k={k}" for k in ks]
    slope_m = (measured[names[-1]] - measured[names[0]]) / (ks[-1] - ks[0])
    slope_p = (predicted[names[-1]] - predicted[names[0]]) / (ks[-1] - ks[0])
    print(
        f"GPipe, per added micro-batch: measured {slope_m * 1e3:.3f} ms, predicted {slope_p * 1e3:.3f} ms: "
        f"{(slope_m - slope_p) * 1e6 / 2:.0f} us per action unpriced (each added micro-batch puts one "
        "forward and one backward action on the critical path)"
    )


if __name__ == "__main__":
    main()
