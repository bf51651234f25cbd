"""The cost model against published, measured training runs: each run's layout forced and priced.

    .venv/bin/python benchmarks/bench_published.py [--row NAME ...] [--quick] [--outputs loss|local] [--list]

For each run of ``published_runs.RUNS`` (dense transformers on 8 to 16,384 A100/H100 GPUs, each
cited there): the model at its published shape on the meta device, its global batch and sequence,
the loss alone as output (``Outputs.LOSS``, as a training step computes it; ``--outputs local``: each
rank's piece of every output), and

* **forced**: the published layout as search options (mesh of DP x CP x TP axes with those roles,
  pipeline stages, schedule, chunks per rank, micro-batches = global batch / (DP x micro-batch
  size), recomputation, ZeRO stage, precision, the fused kernels where the run had none); what the
  source does not give is left to the search and shown as "search"; priced with no memory
  reserve (``ClusterSpec.memory_reserve`` 0: the run fitted). Its predicted step is converted to
  the source's own measure, counting FLOPs as the source counts them (``published_runs.FLOP_COUNTS``), and set against
  the measured figure: error = predicted / measured - 1 (positive: autopar prices the run faster
  than it ran);
* **autopar**: the search's own plan for the same model, batch, cluster and precision, in the same
  measure (skipped with ``--quick``).

A run autopar cannot express, or one it refuses ("no plan fits"), is reported with the reason.
The median and maximum absolute error are over the runs whose forced layout was priced. Figures,
with the machine and the command, are recorded in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import time

import torch
from bench_plan_quality import describe
from published_runs import BY_NAME, FLOP_COUNTS, MEASURES, RUNS, Run

import autopar
from autopar import AxisRole, Float8, Offload, Outputs, Precision, Recompute
from autopar.examples import gpt3, llama
from autopar.report.memory import memory_parts
from autopar.report.parts import step_parts


def build(run: Run):
    """The run's model on the meta device and its example inputs (the global batch): a Llama, or
    for the GPT rows (Megatron's GPT, MPT) ``examples.gpt3``: per-head Q/K/V and one-op GELU as
    those implementations run them (GPT-2's [q | k | v] projection and seven-op GELU priced the
    rows 4-30% slower with reshuffles and elementwise work they never ran)."""
    dtype = "bfloat16"
    if run.family in ("deepseek_v3", "qwen3_moe"):  # their Hugging Face configs, as bench_moe plans them
        from bench_moe import deepseek_v3, qwen3_235b

        cls, cfg = (deepseek_v3 if run.family == "deepseek_v3" else qwen3_235b)()
        with torch.device("meta"):
            model = cls(cfg)
        ids = torch.zeros(run.batch, run.seq, dtype=torch.long, device="meta")
        return model, {"input_ids": ids, "labels": ids}
    with torch.device("meta"):
        if run.family == "llama":
            return llama(**run.model, batch=run.batch, seq=run.seq, dtype=dtype)
        return gpt3(**run.model, batch=run.batch, seq=run.seq, dtype=dtype, attention=run.attention)


def precision(run: Run) -> Precision:
    return Precision.PARAM if run.bf16_params else run.precision


def forced_options(run: Run) -> dict:
    """The published layout as ``autopar.plan`` options; what the source leaves out stays auto. A
    run with expert parallelism folded over its TP x DP ranks (``Run.ep``, Megatron's MoE layout)
    takes them as one expert axis: autopar splits the experts over one mesh axis."""
    axes = [(n, role) for n, role in ((run.dp, AxisRole.DATA), (run.cp, AxisRole.SEQUENCE),
                                      (run.tp, AxisRole.TENSOR)) if n > 1] or [(1, AxisRole.DATA)]  # fmt: skip
    if run.ep > 1:
        if run.ep != run.tp * run.dp or run.cp > 1:
            raise ValueError(
                f"{run.name}: EP{run.ep} over TP{run.tp} x DP{run.dp} x CP{run.cp} is not one axis"
            )
        axes = [(run.ep, AxisRole.EXPERT)]
    batch_ranks = run.ep if run.ep > 1 else run.dp
    opts = dict(
        mesh_shape=tuple(n for n, _ in axes), axis_roles=tuple(r for _, r in axes),
        precision=precision(run), pipeline_stages=run.pp,
    )  # fmt: skip
    if run.pp > 1 and run.schedule is not None:
        opts["schedule"] = run.schedule
        if run.virtual:
            opts["virtual_stages"] = run.virtual
    if run.mbs is not None:
        opts["micro_batches"] = run.batch // (batch_ranks * run.mbs)
    if run.recompute is not None:
        opts["recompute"] = run.recompute
    if run.zero is not None:
        opts["zero_stage"] = run.zero
    opts["offload"] = Offload.NONE  # no published run here offloaded
    opts["float8"] = run.float8  # FP8 linears where the run had them, none where it did not
    if run.kernels is not None:
        opts["kernels"] = run.kernels
    if run.dispatch is not None:
        opts["expert_dispatch"] = run.dispatch
    if run.tp_overlap is not None:
        opts["overlap_matmuls"] = run.tp_overlap
    if run.sp is False and run.tp > 1:  # Megatron-LM without --sequence-parallel: norms whole per rank
        opts["sequence_parallel"] = False
    return opts


def flops(run: Run, model) -> float:
    """FLOPs of one step as the run's source counts them (``FLOP_COUNTS``)."""
    if run.flops == "tokens":
        return 0.0
    b, s = run.batch, run.seq
    m = run.model
    layers, h, v = m["layers"], m["hidden"], m.get("vocab", 128256)
    if run.flops == "sc21":
        return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    if run.flops == "megatron":
        return 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
    if run.flops == "palm":
        n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
        return (6 * n + 12 * layers * h * s) * b * s
    return 0.0


def in_measure(run: Run, step_s: float, cluster, step_flops: float) -> float:
    """A predicted step time as the run's measure (``MEASURES``)."""
    world = cluster.world_size
    if run.measure == "tokens":
        return run.batch * run.seq / (step_s * world)
    per_gpu = step_flops / (step_s * world)
    if run.measure == "tflops":
        return per_gpu / 1e12
    return per_gpu / cluster.device.peak_flops_for("bfloat16")


def fmt(run: Run, value: float | None) -> str:
    if value is None:
        return "-"
    if run.measure == "mfu":
        return f"{value:.1%}"
    return f"{value:,.0f}" if run.measure == "tokens" else f"{value:.1f}"


def layout(run: Run) -> str:
    """The published layout in words; "search" where the source does not give a decision."""

    def known(v, text):
        return text if v is not None else "search"

    pipe = f"PP{run.pp}"
    if run.pp > 1:
        sched = run.schedule.value if run.schedule else "search"
        pipe += f" {sched}" + (f" x{run.virtual}" if run.virtual else "")
    mb = f"mbs {run.mbs} ({run.batch // (run.dp * run.mbs)} micro-batches)" if run.mbs else "mbs search"
    sp = {True: "SP", False: "no SP", None: ""}[run.sp]
    prec = "bf16 params" if run.bf16_params else run.precision.value
    if run.float8 is not Float8.OFF:
        prec += f", FP8 linears ({run.float8.value})"
    parts = [f"TP{run.tp}", pipe, f"DP{run.dp}", f"CP{run.cp}", f"EP{run.ep}" if run.ep > 1 else "", mb,
             f"recompute {known(run.recompute, run.recompute.value if run.recompute else '')}",
             f"ZeRO-{known(run.zero, int(run.zero) if run.zero is not None else '')}", sp, prec,
             f"kernels {run.kernels}" if run.kernels else "",
             "TP comm not overlapped" if run.tp_overlap is False and run.tp > 1 else ""]  # fmt: skip
    return ", ".join(p for p in parts if p)


def plan_one(model, inputs, cluster, **options):
    """(plan or None, seconds, the refusal's message or "")."""
    t0 = time.perf_counter()
    try:
        plan = autopar.plan(model, cluster, inputs, **options)
    except autopar.AutoparError as e:
        return None, time.perf_counter() - t0, f"{type(e).__name__}: {e}"
    return plan, time.perf_counter() - t0, ""


def run_row(run: Run, quick: bool, outputs: Outputs = Outputs.LOSS, limit_gib: float | None = None) -> dict:
    row = dict(run=run, error=None, forced=None, search=None, why="", t_forced=0.0, t_search=0.0)
    if run.unpriceable:
        row["why"] = f"not expressible: {run.unpriceable}"
        return row
    model, inputs = build(run)
    cluster = autopar.ClusterSpec.parse(run.cluster)
    f = flops(run, model)
    # the layout ran, so it fits: priced without the margin a plan keeps for what it cannot see
    # (``ClusterSpec.memory_reserve``), which the search's own plan below keeps
    ran = dataclasses.replace(cluster, memory_reserve=0.0)
    limit = {} if limit_gib is None else {"memory_limit_bytes": limit_gib * 2**30}
    plan, row["t_forced"], why = plan_one(model, inputs, ran, outputs=outputs, **forced_options(run), **limit)
    if plan is None:
        row["why"] = f"refused: {why}"
    else:
        p = plan.predicted
        row["forced"] = in_measure(run, p.step_time_s, cluster, f)
        row["error"] = row["forced"] / run.measured - 1
        row["peak"] = p.peak_memory_bytes / 2**30
        row["forced_plan"] = describe(plan)
        row["forced_parts"] = (p.step_time_s, p.compute_s, p.comm_s)
        row["parts"] = step_parts(plan).describe()
        mem = memory_parts(plan)
        row["memory"] = f"rank {mem.rank}: " + ", ".join(
            f"{name} {b / 2**30:.1f} GiB" for name, b, _ in mem.parts
        )
    if not quick:
        own, row["t_search"], own_why = plan_one(
            model, inputs, cluster, outputs=outputs, precision=precision(run), float8=run.float8
        )
        if own is None:
            row["search_why"] = own_why
        else:
            row["search"] = in_measure(run, own.predicted.step_time_s, cluster, f)
            row["search_plan"] = describe(own)
    return row


def report(row: dict) -> None:
    """The row as it finishes: everything, for the log."""
    run = row["run"]
    head = f"{run.name} ({run.cluster}, {MEASURES[run.measure]}, {FLOP_COUNTS[run.flops]}): "
    if row["forced"] is None:
        print(head + row["why"], flush=True)
    else:
        step, comp, comm = row["forced_parts"]
        print(
            f"{head}measured {fmt(run, run.measured)}, forced {fmt(run, row['forced'])} "
            f"({row['error']:+.1%}); step {step:.3f} s (compute {comp:.3f} s, comm {comm:.3f} s), peak "
            f"{row['peak']:.1f} GiB; {row['forced_plan']}; {row['t_forced']:.1f} s",
            flush=True,
        )
        print(f"  parts per device: {row['parts']}", flush=True)
        print(f"  peak's parts, {row['memory']}", flush=True)
    if row.get("search_plan"):
        print(
            f"  autopar: {fmt(run, row['search'])}; {row['search_plan']}; {row['t_search']:.1f} s", flush=True
        )
    elif row.get("search_why"):
        print(f"  autopar: no plan ({row['t_search']:.1f} s): {row['search_why']}", flush=True)


def table(rows: list[dict]) -> None:
    print(
        "\n| row | GPUs | source | published layout | measured | forced: predicted | error | peak GiB (published) "
        "| autopar's plan | autopar: predicted | plan s (forced / search) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        run = row["run"]
        gpus = run.tp * run.pp * run.dp * run.cp
        measured = f"{fmt(run, run.measured)} {MEASURES[run.measure]}"
        if row["forced"] is None:
            forced, err, peak = row["why"].replace("|", "/").replace("\n", " ")[:240], "-", "-"
        else:
            forced, err = fmt(run, row["forced"]), f"{row['error']:+.1%}"
            peak = f"{row['peak']:.1f}" + (f" ({run.memory_gib})" if run.memory_gib else "")
        own = row.get("search_plan") or (
            ("no plan: " + row["search_why"][:120]) if row.get("search_why") else "-"
        )
        times = (
            f"{row['t_forced']:.0f} / {row['t_search']:.0f}" if row["t_search"] else f"{row['t_forced']:.0f}"
        )
        print(
            f"| {run.name} | {gpus} | {run.source} | {layout(run)} | {measured} | {forced} | {err} | {peak} | "
            f"{own.replace('|', '/')} | {fmt(run, row['search'])} | {times} |"
        )
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    if errors:
        print(
            f"\npriced {len(errors)} of {len(rows)} rows: median |error| {statistics.median(errors):.1%}, "
            f"max |error| {max(errors):.1%}"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--row", action="append", choices=list(BY_NAME), metavar="NAME", help="run only these (repeatable)"
    )
    ap.add_argument("--quick", action="store_true", help="skip the search's own plan")
    ap.add_argument("--list", action="store_true", help="list the rows and their published layouts")
    ap.add_argument(
        "--outputs", choices=[o.value for o in Outputs], default=Outputs.LOSS.value,
        help="what the planned module returns (default: the loss alone, as a training step needs)",
    )  # fmt: skip
    ap.add_argument(
        "--recompute", choices=[r.value for r in Recompute], default=None,
        help="force this recomputation on the rows' forced layouts (what one the source leaves out costs)",
    )  # fmt: skip
    ap.add_argument(
        "--memory-limit-gib", type=float, default=None,
        help="price the forced layouts under this memory per device (what a refused one would need)",
    )  # fmt: skip
    args = ap.parse_args()
    runs = [BY_NAME[n] for n in args.row] if args.row else list(RUNS)
    if args.recompute:
        runs = [dataclasses.replace(run, recompute=Recompute(args.recompute)) for run in runs]
    if args.list:
        for run in runs:
            print(f"{run.name}: {run.cluster}, {layout(run)}; {run.source}")
        return
    print(
        f"# {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"outputs {args.outputs}"
    )
    rows = []
    for run in runs:
        rows.append(run_row(run, args.quick, Outputs(args.outputs), args.memory_limit_gib))
        report(rows[-1])
    table(rows)


if __name__ == "__main__":
    main()
