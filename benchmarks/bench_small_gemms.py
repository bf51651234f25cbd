"""Small GEMMs against the cost model: linears (forward + backward) of many sizes, timed on two
ranks at once in lockstep, as ``autopar calibrate`` times its matmul shapes.

Prints per shape the measured GFLOP/s and the model's error with a calibrated device
(``--cluster FILE`` from ``autopar calibrate``; default: the device fitted to these very
samples by ``fit_matmul`` + ``matmul_overhead``), with and without ``matmul_overhead_s``, the
fixed cost per GEMM that small GEMMs feel. Launches are the device's ``kernel_launch_s``.

    .venv/bin/python benchmarks/bench_small_gemms.py [--cluster cluster.json] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics

import torch

import autopar
from autopar.cost_model.compute import node_time
from autopar.launch import run_on_ranks
from autopar.tools.calibrate import group_lockstep
from autopar.tools.calibrate_compute import lockstep, matmul_figures, matmul_sample, measure_launch

SHAPES = (
    (128, 64, 128), (256, 128, 64), (128, 128, 128), (256, 128, 128), (256, 64, 256), (256, 256, 128),
    (256, 128, 512), (1024, 128, 128), (2048, 128, 128), (256, 256, 256), (512, 128, 512),
    (512, 512, 512), (32, 512, 1024), (64, 512, 2048),
)  # fmt: skip


def _rank(rank: int, world: int, rounds: int) -> dict:
    dev = torch.device("cpu")
    times: dict = {s: [] for s in SHAPES}
    with lockstep(group_lockstep(None, dev)):
        for _ in range(rounds):
            for shape in SHAPES:
                times[shape].append(matmul_sample(shape, dev, 7)[2])
        launch = measure_launch(dev, 5, inner=20)
    return {"times": {s: statistics.median(v) for s, v in times.items()}, "launch": launch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default=None, help="a calibrated spec file (default: fit these samples)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the shapes; each shape's median")
    args = ap.parse_args()
    res = run_on_ranks(_rank, 2, args.rounds)
    points = [(s, 6.0 * math.prod(s), statistics.median(r["times"][s] for r in res)) for s in SHAPES]
    if args.cluster:
        device = autopar.ClusterSpec.from_file(args.cluster).device
        source = args.cluster
    else:
        launch = statistics.median(r["launch"] for r in res)
        fit = matmul_figures(points, launch)
        device = dataclasses.replace(
            autopar.ClusterSpec.preset("cpu").device,
            peak_flops={"float32": fit["peak_flops"]},
            kernel_launch_s=launch,
            matmul_dim_half=fit["matmul_dim_half"],
            matmul_overhead_s=fit["matmul_overhead_s"],
        )
        source = (
            f"fitted to these samples: rate {fit['flops_effective'] / 1e9:.1f} GFLOP/s, "
            f"intercept {fit['matmul_intercept_s'] * 1e6:.0f} us, D {fit['matmul_dim_half']:g}"
        )
    without = dataclasses.replace(device, matmul_overhead_s=0.0)
    print(f"device: {source}; matmul_overhead_s {device.matmul_overhead_s * 1e6:.1f} us, "
          f"kernel_launch_s {device.kernel_launch_s * 1e6:.1f} us")  # fmt: skip
    print(
        f"{'m x k x n':>16} {'MFLOP':>7} {'meas ms':>8} {'GFLOP/s':>8} {'model err':>10} {'no overhead':>12}"
    )
    errs, errs0 = [], []
    for (m, k, n), flops, t in points:
        kwargs = {"new_grads": 2, "min_dim": min(m, k, n)}
        pred = node_time(flops / 3, 0.0, torch.float32, device, 1, True, **kwargs)
        pred0 = node_time(flops / 3, 0.0, torch.float32, without, 1, True, **kwargs)
        errs.append((pred - t) / t)
        errs0.append((pred0 - t) / t)
        print(f"{f'{m} x {k} x {n}':>16} {flops / 1e6:>7.1f} {t * 1e3:>8.3f} {flops / t / 1e9:>8.1f} "
              f"{errs[-1] * 100:>9.0f}% {errs0[-1] * 100:>11.0f}%")  # fmt: skip
    print(f"median |error|: {statistics.median(map(abs, errs)) * 100:.0f}% "
          f"(without the GEMM overhead: {statistics.median(map(abs, errs0)) * 100:.0f}%)")  # fmt: skip


if __name__ == "__main__":
    main()
