"""Plan quality at published sizes: autopar's plan against the published layout, priced alike.

    .venv/bin/python benchmarks/bench_plan_quality.py [--case NAME ...]

For each case (a model at its published size, on the meta device, bf16, at its published global
batch and sequence, outputs as per-rank pieces): the plan autopar searches (mesh, placements,
memory-for-time trades), its predicted step, peak memory and MFU, and the time planning took;
then the published layout forced (``mesh_shape``, ``axis_roles`` and trades) and priced by the
same cost model, so the two predictions compare like with like, and where the publication gives
one, the published MFU beside the forced layout's predicted MFU (the cost model at scale: the
issue's bar is within 15%).

MFU = model FLOPs per step / (step time x devices x the device's dense bf16 peak), with model
FLOPs ``6 N T + 12 L h s T`` (N the parameters outside the input embedding, T the tokens per step,
L layers, h hidden, s sequence; Korthikanti et al. 2022, PaLM appendix B: recomputation not
counted).

Figures, with the machine and the command, are recorded in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import platform
import time
from dataclasses import dataclass, field

import torch

import autopar
from autopar import AxisRole, Outputs, Precision, Recompute, ZeroStage
from autopar.examples import gpt, llama

D, T = AxisRole.DATA, AxisRole.TENSOR


@dataclass(frozen=True)
class Case:
    name: str
    build: dict  # keyword arguments of the example builder
    family: str  # "llama" | "gpt"
    cluster: str  # preset:nodes x devices
    published: str  # the published layout, in words, with its figure
    forced: dict | None = field(default=None)  # the published layout as search options; None: not expressible
    published_mfu: float | None = None  # the published MFU (model FLOPs, recomputation not counted)


CASES = {
    c.name: c
    for c in [
        Case(
            "llama3-8b-8xh100", dict(batch=16, seq=8192), "llama", "h100-sxm:1x8",
            "FSDP8 + full recompute, bf16 (torchtitan)",
            dict(mesh_shape=(8,), axis_roles=(D,), zero_stage=ZeroStage.PARAMETERS, recompute=Recompute.FULL,
                 micro_batches=1, precision=Precision.BF16),
        ),
        Case(
            "llama3-70b-256xh100",
            dict(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, batch=512, seq=8192), "llama",
            "h100-sxm:32x8", "FSDP32 x TP8 + full recompute, bf16 (torchtitan)",
            dict(mesh_shape=(32, 8), axis_roles=(D, T), zero_stage=ZeroStage.PARAMETERS,
                 recompute=Recompute.FULL, precision=Precision.BF16),
        ),
        Case(
            "gpt-22b-8xa100", dict(layers=48, hidden=6144, heads=64, batch=4, seq=2048), "gpt", "a100-80gb:1x8",
            "TP8, selective recompute, 41.5% MFU (Korthikanti et al. 2022)",
            dict(mesh_shape=(8,), axis_roles=(T,), zero_stage=ZeroStage.NONE, recompute=Recompute.SELECTIVE,
                 micro_batches=1, precision=Precision.BF16),
        ),
        Case(
            "gpt-175b-64xa100", dict(layers=96, hidden=12288, heads=96, batch=64, seq=2048), "gpt",
            "a100-80gb:8x8", "TP8 x PP8, selective recompute, 51.4% MFU (Korthikanti et al. 2022)",
            dict(pipeline_stages=8, mesh_shape=(8,), axis_roles=(T,), schedule="1f1b", micro_batches=64,
                 recompute=Recompute.SELECTIVE, zero_stage=ZeroStage.NONE, precision=Precision.BF16),
            0.514,
        ),
        Case(
            "gpt-530b-280xa100", dict(layers=105, hidden=20480, heads=128, batch=280, seq=2048), "gpt",
            "a100-80gb:35x8", "TP8 x PP35, selective recompute, 56.0% MFU (Korthikanti et al. 2022)",
            dict(pipeline_stages=35, mesh_shape=(8,), axis_roles=(T,), schedule="1f1b", micro_batches=280,
                 recompute=Recompute.SELECTIVE, zero_stage=ZeroStage.NONE, precision=Precision.BF16),
            0.560,
        ),
        Case(
            "gpt-1t-512xa100", dict(layers=128, hidden=25600, heads=160, batch=512, seq=2048), "gpt",
            "a100-80gb:64x8", "TP8 x PP64, selective recompute, 56.3% MFU (Korthikanti et al. 2022)",
            dict(pipeline_stages=64, mesh_shape=(8,), axis_roles=(T,), schedule="1f1b", micro_batches=512,
                 recompute=Recompute.SELECTIVE, zero_stage=ZeroStage.NONE, precision=Precision.BF16),
            0.563,
        ),
        Case(
            "gpt-175b-1024xa100", dict(layers=96, hidden=12288, heads=96, batch=1536, seq=2048), "gpt",
            "a100-80gb:128x8",
            "DP8 x TP8 x PP16, full recompute, 153 TFLOP/s per GPU counting recomputation (49% of peak; "
            "36.8% MFU without it) (Narayanan et al. 2021)",
            dict(pipeline_stages=16, mesh_shape=(8, 8), axis_roles=(D, T), schedule="1f1b", micro_batches=192,
                 recompute=Recompute.FULL, zero_stage=ZeroStage.NONE, precision=Precision.BF16),
            0.368,
        ),
    ]
}  # fmt: skip


def build(case: Case):
    with torch.device("meta"):
        if case.family == "llama":
            model, inputs = llama(**case.build)
        else:
            model, inputs = gpt(**case.build)
    return model, inputs


def model_flops(model, case: Case) -> float:
    b = case.build
    tokens = b["batch"] * b["seq"]
    layers = b.get("layers", 32)
    hidden = b.get("hidden", 4096)
    emb = model.get_input_embeddings().weight.numel()
    n = sum(p.numel() for p in model.parameters()) - emb
    out = model.get_output_embeddings()
    if out is not None and out.weight is model.get_input_embeddings().weight:
        n += emb  # a tied head still multiplies
    return 6 * n * tokens + 12 * layers * hidden * b["seq"] * tokens


def plan_row(model, inputs, cluster, flops, **options):
    t0 = time.perf_counter()
    try:
        plan = autopar.plan(model, cluster, inputs, outputs=Outputs.LOCAL, **options)
    except autopar.NoPlanFitsError as e:
        return None, time.perf_counter() - t0, str(e)
    dt = time.perf_counter() - t0
    peak = cluster.device.peak_flops_for("bfloat16")
    mfu = flops / (plan.predicted.step_time_s * cluster.world_size * peak)
    return plan, dt, f"{mfu:.1%}"


def describe(plan) -> str:
    roles = next(
        (c.get("axis_roles") for c in plan.solver.candidates
         if c.get("status") not in ("infeasible", "pruned") and c.get("objective") is not None
         and tuple(c["mesh_shape"]) == tuple(plan.mesh_shape) and c.get("trades") == plan.trades.to_dict()),
        None,
    )  # fmt: skip
    mesh = "x".join(map(str, plan.mesh_shape))
    pipe = f" x {plan.pipeline.describe()}" if plan.pipeline.enabled else ""
    return f"mesh {mesh}{' ' + str(roles) if roles else ''}{pipe}; {plan.trades.describe()}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", choices=list(CASES), help="run only these (repeatable)")
    args = ap.parse_args()
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}")
    for name in args.case or list(CASES):
        case = CASES[name]
        model, inputs = build(case)
        cluster = autopar.ClusterSpec.parse(case.cluster)
        flops = model_flops(model, case)
        report(f"{name}: autopar", *plan_row(model, inputs, cluster, flops), planned=True)
        if case.forced is None:
            print(f"{name}: published: {case.published}: not expressible yet", flush=True)
            continue
        forced = plan_row(model, inputs, cluster, flops, **case.forced)
        report(f"{name}: published ({case.published}) forced", *forced)
        if case.published_mfu is not None and forced[0] is not None:
            mfu = float(forced[2].rstrip("%")) / 100
            print(
                f"{name}: forced layout's predicted MFU {mfu:.1%} vs published {case.published_mfu:.1%}: "
                f"{mfu / case.published_mfu - 1:+.1%}",
                flush=True,
            )


def report(label: str, plan, dt: float, mfu: str, planned: bool = False) -> None:
    """One row: what the plan chose and its predictions (``mfu``: the error where there is none)."""
    if plan is None:
        print(f"{label}: no plan ({dt:.1f} s): {mfu}", flush=True)
        return
    p = plan.predicted
    print(
        f"{label}: {describe(plan)}; step {p.step_time_s * 1e3:.0f} ms, peak "
        f"{p.peak_memory_bytes / 2**30:.1f} GiB, MFU {mfu}" + (f", planned in {dt:.1f} s" if planned else ""),
        flush=True,
    )


if __name__ == "__main__":
    main()
