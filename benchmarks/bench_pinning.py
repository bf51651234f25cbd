"""Step time with each gloo rank bound to a core (``autopar.launch.pin_to_core``) against unbound.

Plans one model with each role of ``bench_cost_accuracy.PLANS`` on ``--world`` local ranks (a
calibrated spec: ``--cluster FILE``, else the ``cpu`` preset: the plans only need to exist), then
times them as the accuracy benchmark does (interleaved rounds of back-to-back SGD steps, the
slowest rank per round, the median over rounds), once with the ranks bound and once unbound,
alternating ``--repeats`` times, and prints the median of each.

    .venv/bin/python benchmarks/bench_pinning.py --model gpt2_tiny --world 4 [--cluster cluster.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench_cost_accuracy import MODELS, PLANS, _rank_run  # this folder: the accuracy benchmark's cases

import autopar
from autopar.launch import run_on_ranks
from autopar.model_spec import load_model_spec
from autopar.passes.solver import mesh_candidates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2_tiny")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--cluster", default=None, help="a spec file to plan with (default: the cpu preset)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each binding, alternating")
    args = ap.parse_args()
    spec = MODELS.get(args.model, args.model)
    base = autopar.ClusterSpec.from_file(args.cluster) if args.cluster else autopar.ClusterSpec.preset("cpu")
    cluster = base.with_overrides(nodes=1, devices_per_node=args.world)
    out = Path(tempfile.mkdtemp(prefix="bench_pinning_"))
    files = {}
    for name, roles in PLANS.items():
        if roles and not any(
            len(m) == len(roles) for m in mesh_candidates(args.world, len(roles), args.world)
        ):
            continue
        model, inputs = load_model_spec(spec)
        plan = autopar.plan(model, cluster, inputs, axis_roles=roles, optimizer=autopar.Optimizer.SGD)
        files[name] = str(out / f"{name}.json")
        plan.save(files[name])
        print(f"{name:<6} mesh {'x'.join(map(str, plan.mesh_shape))}")
    times: dict[bool, dict[str, list[float]]] = {True: {}, False: {}}
    for _ in range(args.repeats):
        for pin in (True, False):
            res = run_on_ranks(
                _rank_run, args.world, spec, cluster.to_dict(), files, args.rounds, pin_cores=pin
            )
            for name in files:
                times[pin].setdefault(name, []).append(max(r[name][0] for r in res))
    print(f"\n{args.model}, {args.world} gloo ranks on {autopar.cluster.usable_cores()} cores: ms per step")
    print(f"{'plan':<6} {'bound':>8} {'unbound':>8} {'change':>7}")
    for name in files:
        b, u = statistics.median(times[True][name]), statistics.median(times[False][name])
        print(f"{name:<6} {b * 1e3:>8.2f} {u * 1e3:>8.2f} {(b - u) / u * 100:>6.0f}%")


if __name__ == "__main__":
    main()
