"""The ``autopar`` command line.

    autopar demo [--out DIR] [--model MODEL_SPEC] [--world-size N] [--cluster SPEC_FILE]
    autopar plan MODEL_SPEC --cluster PRESET[:NODESxDEVICES] | SPEC_FILE --out plan.json [--report r.html]
                 [--mesh AxB] [--axis-roles data,tensor] [--recompute ..] [--recompute-blocks N] [--micro-batches K] [--zero-stage ..] [--offload ..]
                 [--precision ..] [--float8 ..] [--pipeline-stages N] [--schedule ..] [--virtual-stages N]
                 [--sequence-attention gather|ring|all_to_all] [--kernels auto|all|none|K1,K2]
                 [--overlap-matmuls auto|on|off] [--no-sequence-parallel] [--expert-skew X]
                 [--expert-dispatch auto|expert_all_to_all]
                 [--profile [--profile-cache PATH] [--profile-threads N]]
    autopar report PLAN.json [--out report.html] [--title TEXT]
    autopar calibrate [--world-size N] [--out cluster.json] [--quick]
    autopar coverage MODEL_SPEC [--json]

MODEL_SPEC is ``path/to/file.py:function`` or ``package.module:function`` (a callable returning
``(model, example_inputs)``), e.g. ``autopar.examples:gpt2_tiny``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from autopar.demo import DEMO_MODEL
from autopar.errors import AutoparError
from autopar.fusion import Kernel, KernelsError, coerce_kernels
from autopar.options import AxisRole
from autopar.placement import ExpertDispatch, Outputs, SeqAttention
from autopar.trades import Recompute, Schedule


def _mesh(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad mesh {text!r}: use e.g. 4 or 2x2") from None


def _axis_roles(text: str) -> tuple[AxisRole, ...]:
    """``data,tensor`` -> (AxisRole.DATA, AxisRole.TENSOR): one role per mesh axis, outermost first."""
    names = [x.strip().lower() for x in text.split(",")]
    valid = [r.value for r in AxisRole]
    bad = [n for n in names if n not in valid]
    if bad:
        raise argparse.ArgumentTypeError(
            f"bad axis role{'s' if len(bad) > 1 else ''} {', '.join(repr(b) for b in bad)} in {text!r}: "
            f"give one of {', '.join(valid)} per mesh axis, comma separated (e.g. data,tensor for --mesh 2x4)"
        )
    return tuple(AxisRole(n) for n in names)


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar", description="Automatic parallelization for PyTorch models.")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser(
        "demo", help="plan and run a small GPT-2 on local CPU processes; write plan and report"
    )
    d.add_argument("--out", default="autopar_out", help="output folder (default: autopar_out)")
    d.add_argument("--model", default=DEMO_MODEL, help="MODEL_SPEC to run")
    d.add_argument("--world-size", type=int, default=4, help="number of local gloo processes (default: 4)")
    d.add_argument("--steps", type=int, default=3, help="SGD steps compared with the single-device model")
    d.add_argument(
        "--cluster",
        default=None,
        help="a spec file from `autopar calibrate` (default: the uncalibrated cpu preset); its "
        "device and links, with --world-size devices on one node",
    )

    cv = sub.add_parser(
        "coverage",
        help="list the model's ops, which have sharding rules, and which have FLOPs or saved tensors "
        "that could not be derived",
    )
    cv.add_argument("model", metavar="MODEL_SPEC")
    cv.add_argument("--json", action="store_true", help="print JSON instead of a table")

    pl = sub.add_parser("plan", help="search a sharding plan offline and write it as JSON")
    pl.add_argument("model", metavar="MODEL_SPEC")
    pl.add_argument(
        "--cluster", required=True, help="PRESET[:NODESxDEVICES] (e.g. h100-sxm:8x8) or a spec file"
    )
    pl.add_argument("--out", default="plan.json", help="where to write the plan (default: plan.json)")
    pl.add_argument("--report", default=None, help="also write an HTML report here")
    pl.add_argument("--mesh", type=_mesh, default=None, help="fix the mesh shape, e.g. 2x4 (default: search)")
    pl.add_argument(
        "--axis-roles",
        type=_axis_roles,
        default=None,
        metavar="R1,R2",
        help="what each mesh axis is for, outermost first, one of "
        f"{', '.join(r.value for r in AxisRole)} per axis (e.g. data,tensor with --mesh 2x4; "
        "default: the search chooses)",
    )
    pl.add_argument(
        "--memory-limit-gib",
        type=float,
        default=None,
        help="per-device memory in GiB (default: the device's); the plan leaves the cluster's "
        "memory_reserve of it unused (10%% unless the spec file says otherwise)",
    )
    pl.add_argument("--time-limit", type=float, default=None, help="solver time limit per mesh, in seconds")
    pl.add_argument(
        "--expert-skew", type=float, default=1.0,
        help="price mixture-of-experts routing with the busiest rank this many times a balanced share (default 1)",
    )  # fmt: skip
    pl.add_argument(
        "--expert-dispatch", choices=["auto", ExpertDispatch.ALL_TO_ALL.value], default="auto",
        help="how tokens travel to experts split over an axis: auto (the search takes the dispatch once per "
        "node where the axis spans nodes and that is faster) or the flat all-to-all only",
    )  # fmt: skip
    pl.add_argument("--meta", action="store_true", help="build the model on the meta device (no weights)")
    pl.add_argument(
        "--outputs",
        choices=[o.value for o in Outputs],
        default=Outputs.FULL.value,
        help="return each output whole on every rank (full, the default), as each rank's piece "
        "(local: no gathered logits), or the loss alone (loss: the logits are never computed)",
    )
    pl.add_argument(
        "--recompute",
        choices=["auto", *(r.value for r in Recompute)],
        default="auto",
        help="activation recomputation per repeated block (default: auto, the search chooses): "
        "selective keeps every matmul's output, half_matmuls every other one (torchtitan's op SAC)",
    )
    pl.add_argument(
        "--recompute-blocks",
        default="auto",
        metavar="N|auto",
        help="how many repeated blocks of each pipeline stage recompute, the first ones (Megatron-LM's "
        "--recompute-num-layers; default: auto, the search chooses every block or a part)",
    )
    pl.add_argument(
        "--micro-batches", default="auto", metavar="K|auto", help="micro-batches per step (default: auto)"
    )
    pl.add_argument(
        "--zero-stage",
        choices=["auto", "0", "1", "2", "3"],
        default="auto",
        help="ZeRO stage over the data-parallel axes (default: auto)",
    )
    pl.add_argument(
        "--offload",
        choices=["auto", "none", "optimizer", "parameters"],
        default="auto",
        help="keep the optimizer state (optimizer: with ZeRO-2) or also the parameters, streamed per block "
        "(parameters: with ZeRO-3), in host memory (default: auto)",
    )
    pl.add_argument(
        "--precision",
        choices=["auto", "param", "bf16", "fp16"],
        default="auto",
        help="param: the parameters' dtype; bf16/fp16: mixed precision with fp32 masters (default: auto)",
    )
    pl.add_argument(
        "--float8",
        choices=["auto", "off", "tensorwise", "rowwise"],
        default="auto",
        help="FP8 linears (torchao float8 training): auto chooses per linear where the device has an FP8 "
        "rate; tensorwise/rowwise runs every linear that can in that recipe; off: none (default: auto)",
    )
    pl.add_argument(
        "--pipeline-stages",
        default="auto",
        metavar="N|auto",
        help="pipeline stages: the devices as N copies of one stage's mesh, --mesh then that stage's "
        "(default: auto; 1: no pipeline)",
    )
    pl.add_argument(
        "--schedule",
        choices=["auto", *(s.value for s in Schedule)],
        default="auto",
        help="pipeline schedule (default: auto)",
    )
    pl.add_argument(
        "--virtual-stages",
        default="auto",
        metavar="N|auto",
        help="chunks per pipeline rank: 1 for gpipe and 1f1b, 2 or more for interleaved_1f1b and "
        "zero_bubble (default: auto)",
    )
    pl.add_argument(
        "--sequence-attention",
        choices=["auto", *(v.value for v in SeqAttention)],
        default="auto",
        help="attention on a split sequence: K/V gathered, ring, or all-to-all (Ulysses) (default: auto, "
        "by cost per attention)",
    )
    pl.add_argument(
        "--kernels",
        default="auto",
        metavar="auto|all|none|K1,K2",
        help="fused kernels to substitute: auto (all on GPUs, none on CPUs), all, none, or a comma-separated "
        f"list of {', '.join(k.value for k in Kernel)}",
    )
    pl.add_argument(
        "--overlap-matmuls",
        choices=["auto", "on", "off"],
        default="auto",
        help="run the all-gather before a linear, or the reduce-scatter after it, as one collective "
        "matmul whose communication overlaps the matmul's chunks (default: auto, on where devices overlap "
        "communication with compute: GPUs)",
    )
    pl.add_argument(
        "--no-sequence-parallel",
        action="store_true",
        help="keep every normalization layer whole on each rank of a tensor axis (Megatron-LM without "
        "--sequence-parallel); default: the search may split them on the sequence",
    )
    pl.add_argument(
        "--profile",
        action="store_true",
        help="price ops by running them on this machine (cached) instead of the analytical model; "
        "the cluster's device must be this machine's kind",
    )
    pl.add_argument(
        "--profile-cache",
        default=None,
        metavar="PATH",
        help="op timing cache for --profile (default: ~/.cache/autopar/op_profile.json)",
    )
    pl.add_argument(
        "--profile-threads",
        type=int,
        default=None,
        metavar="N",
        help="intra-op threads while profiling on CPU (default: 1, as CPU ranks run)",
    )

    rp = sub.add_parser("report", help="render a saved plan's HTML report again")
    rp.add_argument("plan", metavar="PLAN.json", help="a plan written by `autopar plan` or Plan.save")
    rp.add_argument("--out", default="report.html", help="where to write the report (default: report.html)")
    rp.add_argument("--title", default=None, help="the page's title (default: autopar plan: MODEL)")

    ca = sub.add_parser(
        "calibrate", help="measure links and device on local gloo processes; write a spec file"
    )
    ca.add_argument("--world-size", type=int, default=2, help="number of local gloo processes (default: 2)")
    ca.add_argument("--out", default="cluster.json", help="where to write the spec (default: cluster.json)")
    ca.add_argument("--quick", action="store_true", help="few sizes and repeats (seconds, noisier)")
    return p


def _cmd_calibrate(args) -> int:
    from autopar.tools.calibrate import run_calibration

    cal = run_calibration(args.world_size, out_path=args.out, quick=args.quick)
    print(cal.table())
    print(f"wrote {args.out}")
    return 0


def _cmd_plan(args) -> int:
    import gc

    import torch

    import autopar
    from autopar.model_spec import load_model_spec
    from autopar.passes.search import GC_GEN0_THRESHOLD
    from autopar.report import write_report

    cluster = autopar.ClusterSpec.parse(args.cluster)
    profile = False
    if args.profile:
        from autopar.tools.profiler import OpProfiler

        profile = OpProfiler.for_cluster(
            cluster,
            cache_path=args.profile_cache,
            num_threads=args.profile_threads,
            progress=lambda m: print(m, flush=True),
        )
    elif args.profile_cache or args.profile_threads:
        print("autopar: error: --profile-cache and --profile-threads need --profile", file=sys.stderr)
        return 2
    # this process builds the model, then searches: both allocate objects by the million, and at
    # CPython's default threshold the collector keeps walking torch's (``passes/search.py``)
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
    if args.meta:
        with torch.device("meta"):
            model, inputs = load_model_spec(args.model)
    else:
        model, inputs = load_model_spec(args.model)

    def auto(text, kind=str):
        return None if text == "auto" else kind(text)

    counts = {}
    for flag in ("micro_batches", "pipeline_stages", "virtual_stages", "recompute_blocks"):
        text = getattr(args, flag)
        try:
            counts[flag] = auto(text, int)
        except ValueError:
            what = "an integer >= 0" if flag == "recompute_blocks" else "a positive integer"
            print(f"autopar: error: --{flag.replace('_', '-')} must be {what} or auto, got {text!r}",
                  file=sys.stderr)  # fmt: skip
            return 2
    try:
        kernels = coerce_kernels(args.kernels)
    except KernelsError as e:
        print(f"autopar: error: --kernels: {e}", file=sys.stderr)
        return 2
    options = autopar.SearchOptions(
        kernels=kernels,
        recompute=auto(args.recompute),
        recompute_blocks=counts["recompute_blocks"],
        micro_batches=counts["micro_batches"],
        pipeline_stages=counts["pipeline_stages"],
        schedule=auto(args.schedule),
        virtual_stages=counts["virtual_stages"],
        sequence_attention=auto(args.sequence_attention),
        overlap_matmuls=auto(args.overlap_matmuls, lambda v: v == "on"),
        zero_stage=auto(args.zero_stage, int),
        offload=auto(args.offload),
        precision=auto(args.precision),
        float8=auto(args.float8),
        mesh_shape=args.mesh,
        axis_roles=args.axis_roles,
        memory_limit_bytes=args.memory_limit_gib * 2**30 if args.memory_limit_gib is not None else None,
        time_limit_s=args.time_limit,
        expert_skew=args.expert_skew,
        expert_dispatch=auto(args.expert_dispatch),
        sequence_parallel=not args.no_sequence_parallel,
        outputs=Outputs(args.outputs),
    )
    # the profiler (a measuring resource, not a search option) goes in beside the options
    plan = autopar.plan(
        model, cluster, inputs, options, progress=lambda m: print(m, flush=True), profile=profile
    )
    plan.save(args.out)
    print(plan.summary())
    print(f"wrote {args.out}")
    if args.report:
        print(f"wrote {write_report(plan, args.report)}")
    return 0


def _cmd_report(args) -> int:
    import autopar
    from autopar.report import write_report

    try:
        plan = autopar.Plan.load(args.plan)
    except OSError as e:
        print(f"autopar: error: cannot read the plan {args.plan}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {write_report(plan, args.out, title=args.title)}")
    return 0


def _cmd_coverage(args) -> int:
    import json

    from autopar.coverage import coverage, format_table
    from autopar.model_spec import load_model_spec

    rows = coverage(*load_model_spec(args.model))
    print(json.dumps([r.to_dict() for r in rows], indent=1) if args.json else format_table(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _build_parser().parse_args(argv)
    try:
        if args.cmd == "demo":
            from autopar.demo import run_demo

            cluster = None
            if args.cluster:
                from autopar.cluster import ClusterSpec

                cluster = ClusterSpec.from_file(args.cluster).with_overrides(
                    nodes=1, devices_per_node=args.world_size
                )
            run_demo(args.out, args.model, args.world_size, args.steps, cluster=cluster)
            return 0
        if args.cmd == "plan":
            return _cmd_plan(args)
        if args.cmd == "calibrate":
            return _cmd_calibrate(args)
        if args.cmd == "report":
            return _cmd_report(args)
        if args.cmd == "coverage":
            return _cmd_coverage(args)
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2
    return 1


# commands whose process has nothing left to do once ``main`` returns: their files are written and
# closed, their output printed. The interpreter's teardown would walk every object torch and the
# search left alive (1.5 s after planning an 8B Llama, a seventh of the command: benchmarks/README.md)
QUICK_EXIT = ("plan", "report", "coverage")


def run() -> None:
    """The ``autopar`` console script: ``main``, then the exit; for ``QUICK_EXIT`` commands, with
    the output flushed and the logs shut down, without the interpreter's teardown."""
    argv = sys.argv[1:]
    rc = main(argv)
    if argv and argv[0] in QUICK_EXIT:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    run()
