"""A GPU preset against single-op times measured on the GPU it describes, and the fit of its figures.

    .venv/bin/python benchmarks/bench_gpu_preset.py [--preset h100-sxm] [--reference FILE] [--rows] [--fit]

For every row of the reference file (default ``cost_model/reference/h100_ops.jsonl``: one H100
80GB HBM3, torch 2.11.0+cu130), the seconds the preset's device is priced at through the cost
model's own path (``autopar/tools/op_reference.py``: the op traced on the meta device, analyzed,
and priced by ``passes/costs.analytical_node_time``; Adam steps by
``cost_model.compute.optimizer_step_time``) against the measured seconds: per op family the
median |predicted / measured - 1| and the worst error (``--rows``: every row). Nothing runs on a
GPU: the table is the same on any machine.

``--fit`` prints the figures ``op_reference.fit_figures`` fits to the file (what ``autopar/presets.py``
sets for ``h100-sxm`` and ``h200``, and ``tests/test_gpu_preset.py`` holds it to) and the
per-dtype matmul efficiency left free (a check of ``cost_model.compute.EFF_MAX``).

Figures, with the machine and the command, are recorded in benchmarks/README.md.
"""

from __future__ import annotations

import argparse

import autopar
from autopar.cost_model.compute import EFF_MAX
from autopar.tools.op_reference import (
    H100_OPS,
    describe,
    efficiency,
    errors,
    fit_figures,
    load_samples,
    predict,
    summary,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="h100-sxm", help="the ClusterSpec preset whose device is priced")
    ap.add_argument("--reference", default=str(H100_OPS), help="the measured ops (JSON lines)")
    ap.add_argument("--rows", action="store_true", help="print every row, not only the summary")
    ap.add_argument("--fit", action="store_true", help="print the figures fitted to the reference")
    args = ap.parse_args()
    samples = load_samples(args.reference)
    device = autopar.ClusterSpec.preset(args.preset).device
    by_family = errors(predict(samples, device))
    print(f"{args.preset} ({device.name}) against {args.reference}")
    if args.rows:
        print(
            f"{'family':<22} {'dtype':<13} {'shape':<24} {'measured ms':>12} {'predicted ms':>13} {'ratio':>6}"
        )
        for family, rows in by_family.items():
            for s, e in rows:
                print(f"{family:<22} {s.dtype:<13} {describe(s):<24} {s.seconds * 1e3:>12.4f} "
                      f"{s.seconds * (1 + e) * 1e3:>13.4f} {1 + e:>6.2f}")  # fmt: skip
        print()
    print(f"{'family':<28} {'rows':>4} {'median |err|':>13} {'worst err':>10}  worst row")
    for family, rows in by_family.items():
        lines = [(family, rows)]
        if family == "mm bfloat16":
            lines.append(("mm bfloat16, m n k >= 1024", [(s, e) for s, e in rows if s.large_gemm]))
        for name, sub in lines:
            med, worst = summary([e for _, e in sub])
            at = next(s for s, e in sub if e == worst)
            print(f"{name:<28} {len(sub):>4} {med * 100:>12.1f}% {worst * 100:>+9.1f}%  "
                  f"{at.dtype} {describe(at)}")  # fmt: skip
    if args.fit:
        peaks = dict(device.peak_flops)
        fig = fit_figures(samples, peaks)
        print("\nfitted figures (autopar/tools/op_reference.py: fit_figures):")
        print(f"  kernel_launch_s    {fig.kernel_launch_s:g} s")
        print(f"  memory_bandwidth   {fig.memory_bandwidth:g} B/s")
        print(f"  matmul_dim_half    {fig.matmul_dim_half:g}")
        print(f"  matmul_overhead_s  {fig.matmul_overhead_s:g} s")
        for op, f, b in fig.pointwise_s:
            print(f"  pointwise_s        {op}: forward {f:g}, backward {b:g} s per element")
        for name, v in fig.optimizer_param_s:
            print(f"  optimizer_param_s  {name}: {v:g} s per tensor")
        eff = efficiency(samples, peaks)
        print("  matmul efficiency left free (EFF_MAX = {:g}): {}".format(
            EFF_MAX, ", ".join(f"{dt} {v:.3f}" for dt, v in eff.items())))  # fmt: skip


if __name__ == "__main__":
    main()
