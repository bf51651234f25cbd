"""Overlapped vs inline gradient all-reduce: what it saves when run, and what the model predicted.

For each model, one data-parallel plan (``axis_roles=(DATA,)``) is built twice on every rank: as
codegen emits it (deferred gradient all-reduces, ``codegen/grad_sync.py``) and with every "f"
inline (``passes/grad_sync.deferred_grad_axes`` patched to defer nothing). The two are timed in
interleaved rounds (the slowest rank's step, median over rounds). The model's side: the plan's
prediction with the cluster's ``comm_overlap`` and with ``comm_overlap = 0``, and the seconds it
predicts hidden.

    .venv/bin/python benchmarks/bench_grad_overlap.py [--cluster cluster.json] [--world 2] [--rounds 20]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import autopar
import autopar.codegen.build as build
from autopar.demo import train_step
from autopar.launch import run_on_ranks
from autopar.model_spec import load_model_spec
from autopar.tools.calibrate import run_calibration
from autopar.tools.measure import time_interleaved

MODELS = {
    "gpt2_tiny": "autopar.examples:gpt2_tiny(batch=8, seq=64, hidden=128, vocab=512)",
    "llama_tiny": "autopar.examples:llama_tiny(batch=8, seq=64, hidden=128, vocab=512)",
    "mlp": "autopar.examples:mlp(batch=64, hidden=512, ffn=2048)",
}
WARMUP = 3


def _rank(rank: int, world: int, spec: str, cluster_dict: dict, path: str, rounds: int) -> dict:
    cluster = autopar.ClusterSpec.from_dict(cluster_dict)
    runs = {}
    for mode in ("overlapped", "inline"):
        torch.manual_seed(0)
        model, inputs = load_model_spec(spec)
        real = build.deferred_grad_axes
        if mode == "inline":
            build.deferred_grad_axes = lambda *a: {}
        try:
            pm = autopar.autoparallelize(model, cluster, inputs, plan=path)
        finally:
            build.deferred_grad_axes = real
        opt = torch.optim.SGD(pm.parameters(), lr=0.01)
        runs[mode] = (lambda m=pm, o=opt, x=inputs: train_step(m, o, x), len(pm.grad_sync._bucket_of))  # noqa: E731
    times = time_interleaved({k: step for k, (step, _) in runs.items()}, rounds, WARMUP)
    return {k: (times[k], runs[k][1]) for k in runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default=None, help="a calibrated spec file (default: calibrate now)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    if args.cluster:
        cluster = autopar.ClusterSpec.from_file(args.cluster)
    else:
        cluster = run_calibration(args.world).cluster
    cluster = cluster.with_overrides(nodes=1, devices_per_node=args.world)
    inline_cluster = cluster.with_overrides(device=dataclasses.replace(cluster.device, comm_overlap=0.0))
    print(f"world {args.world}, comm_overlap {cluster.device.comm_overlap:.2f} (calibrated)")
    print(
        f"{'model':<11} {'deferred':>8} {'pred eta=0':>11} {'pred':>9} {'pred hidden':>11} "
        f"{'meas inline':>11} {'meas ovl':>9} {'meas saved':>10}"
    )
    for name, spec in MODELS.items():
        model, inputs = load_model_spec(spec)
        kw = dict(
            mesh_shape=(args.world,), axis_roles=(autopar.AxisRole.DATA,), optimizer=autopar.Optimizer.SGD
        )
        plan = autopar.plan(model, cluster, inputs, **kw)
        plan0 = autopar.plan(model, inline_cluster, inputs, **kw)
        path = f"/tmp/bench_grad_overlap_{name}.json"
        plan.save(path)
        res = run_on_ranks(_rank, args.world, spec, cluster.to_dict(), path, args.rounds)[0]
        (t_ovl, n_def), (t_inl, _) = res["overlapped"], res["inline"]
        p, p0 = plan.predicted, plan0.predicted
        print(
            f"{name:<11} {n_def:>8} {p0.step_time_s * 1e3:>9.2f}ms {p.step_time_s * 1e3:>7.2f}ms "
            f"{p.grad_sync_hidden_s * 1e3:>9.2f}ms {t_inl * 1e3:>9.2f}ms {t_ovl * 1e3:>7.2f}ms "
            f"{(t_inl - t_ovl) * 1e3:>8.2f}ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
