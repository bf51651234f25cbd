"""Long sequences: which plans exist for Llama-3-8B at 32k, 128k and 256k tokens per sequence.

    .venv/bin/python benchmarks/bench_context_parallel.py [--case NAME ...] [--forced]

For each case (Llama-3-8B on the meta device, bf16, one sequence per step, as long-context steps are, outputs as
per-rank pieces): the plan autopar searches, what it chose (mesh, trades, and how each attention
runs where its sequence is split: K/V gathered, ring, or all-to-all), its predicted step, peak
memory and MFU, and the time planning took. ``--forced`` also prices the same search with the
attention algorithm forced to each of the three (``sequence_attention``), so the choice can be
read against the alternatives priced alike.

MFU as in ``bench_plan_quality.py`` (model FLOPs ``6 N T + 12 L h s T``, causal attention counted
whole). Figures, with the machine and the command, are recorded in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import platform

import torch
from bench_plan_quality import Case, build, model_flops, plan_row

import autopar
from autopar import SeqAttention

LLAMA3_8B = dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8)
CASES = {
    f"llama3-8b-{seq // 1024}k-{nodes * 8}xh100": Case(
        f"llama3-8b-{seq // 1024}k-{nodes * 8}xh100", dict(**LLAMA3_8B, batch=1, seq=seq), "llama",
        f"h100-sxm:{nodes}x8", "",
    )
    for nodes in (1, 8)
    for seq in (32768, 131072, 262144)
}  # fmt: skip


def attention_line(plan) -> str:
    line = next((x.strip() for x in plan.summary().split("\n") if "attention on a split sequence" in x), "")
    return line.replace("attention on a split sequence: ", "") or "sequence not split"


def row(label: str, model, inputs, cluster, flops, **options) -> None:
    """Plan (``bench_plan_quality.plan_row``: local outputs, timed, MFU) and print one row."""
    plan, dt, mfu = plan_row(model, inputs, cluster, flops, **options)
    if plan is None:
        print(f"{label}: no plan ({dt:.1f} s): {mfu}", flush=True)
        return
    p = plan.predicted
    mesh = "x".join(map(str, plan.mesh_shape))
    pipe = f" x {plan.pipeline.describe()}" if plan.pipeline.enabled else ""
    print(
        f"{label}: mesh {mesh}{pipe}; {plan.trades.describe()}; attention: {attention_line(plan)}; "
        f"step {p.step_time_s * 1e3:.0f} ms, peak {p.peak_memory_bytes / 2**30:.1f} GiB, MFU {mfu}, "
        f"planned in {dt:.1f} s",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", choices=list(CASES), help="run only these (repeatable)")
    ap.add_argument("--forced", action="store_true", help="also price each attention algorithm forced")
    args = ap.parse_args()
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}")
    for name in args.case or list(CASES):
        case = CASES[name]
        model, inputs = build(case)
        cluster = autopar.ClusterSpec.parse(case.cluster)
        flops = model_flops(model, case)
        row(f"{name}: autopar", model, inputs, cluster, flops)
        if args.forced:
            for kind in SeqAttention:
                row(f"{name}: {kind.value} forced", model, inputs, cluster, flops, sequence_attention=kind)


if __name__ == "__main__":
    main()
