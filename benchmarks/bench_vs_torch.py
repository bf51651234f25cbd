"""autopar's forced plans against PyTorch's own way of running the same layout: step-time ratios.

For each model (``vs_torch_refs.FAMILIES``: HF Llama, Qwen2, GPT-2 and a plain-torch residual
MLP), size (``tiny``: host-bound; ``large``: compute-bound) and layout, the parent plans autopar
with the layout forced (``LAYOUTS``; every trade forced too: no recomputation, no micro-batches
outside the pipeline, the parameters' precision, no offload; ``outputs=Outputs.LOSS``: a training
step reads the loss alone, as the references compute nothing else), then ONE spawn of gloo ranks
per world size builds, per configuration, both sides from the same weights, batch and optimizer
(``--optimizer``, Adam or SGD, lr ``vs_torch_refs.LR``):

=========  ============================================  ==========================================
layout     autopar                                       reference (``vs_torch_refs.reference``)
=========  ============================================  ==========================================
eager      ``mesh_shape=(1,)``, on one rank              the model itself
ddp        ``(w,)``, ``axis_roles=(DATA,)``, ZeRO 0      ``DistributedDataParallel``
zero2      the same, ``zero_stage=2``                    FSDP2 per block + root, no reshard
zero3      the same, ``zero_stage=3``                    FSDP2 per block + root, reshard
tp         ``(w,)``, ``axis_roles=(TENSOR,)``            ``parallelize_module``, Megatron plan
tp_sp      the same                                      the same + ``SequenceParallel`` (torchtitan)
pp         ``pipeline_stages=2``, ``(w/2,)``,            ``PipelineStage`` per half, cut where
           ``--schedule``, ``--micro-batches``           autopar's plan cuts, the same schedule
=========  ============================================  ==========================================

Feeding: under data parallelism each rank of both sides is given its own rows of the batch
(``--feed slices``, the default; ``ParallelModule.data_rank``), as ``DistributedDataParallel``
and FSDP2 are fed; ``--feed whole`` gives autopar the whole batch on every rank, which its module
slices each step. Each side's first step (fresh weights) must compute the same loss as the other's (rtol 1e-4);
a mismatch is printed as such and not timed (a ratio between different computations means
nothing). Then ``--rounds`` interleaved rounds (after one untimed round), the order alternating
per round, each side one untimed step and then ``--steps`` timed steps; a round's time per step
is the slowest rank's. The table's ratio is autopar's median over the reference's, with the
least and greatest per-round ratio. A layout one side cannot run on a model is printed as
``n/a: why``.

    .venv/bin/python benchmarks/bench_vs_torch.py --quick --world 2          # smoke run, tiny
    .venv/bin/python benchmarks/bench_vs_torch.py --world 2 --world 4        # the measurement
    .venv/bin/python benchmarks/bench_vs_torch.py --models llama --layouts ddp,tp --sizes large
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vs_torch_refs as refs  # noqa: E402

import autopar  # noqa: E402
from autopar.demo import train_step  # noqa: E402
from autopar.launch import PRELOAD_ENV, RankFailed, run_on_ranks  # noqa: E402

LAYOUTS = ("eager", "ddp", "zero2", "zero3", "tp", "tp_sp", "pp")
RTOL = 1e-4
D, T = autopar.AxisRole.DATA, autopar.AxisRole.TENSOR


def plan_options(layout: str, world: int, optimizer: str, schedule: str, k: int) -> dict:
    """autopar's search options that force ``layout`` (and every trade) at ``world`` ranks."""
    opts = dict(
        optimizer=autopar.Optimizer.ADAM if optimizer == "adam" else autopar.Optimizer.SGD,
        outputs=autopar.Outputs.LOSS, recompute=autopar.Recompute.NONE, precision=autopar.Precision.PARAM,
        offload=autopar.Offload.NONE, micro_batches=1, pipeline_stages=1, zero_stage=0,
    )  # fmt: skip
    if layout == "eager":
        return {**opts, "mesh_shape": (1,)}
    if layout in ("ddp", "zero2", "zero3"):
        zero = {"ddp": 0, "zero2": 2, "zero3": 3}[layout]
        return {**opts, "mesh_shape": (world,), "axis_roles": (D,), "zero_stage": zero}
    if layout in ("tp", "tp_sp"):
        return {**opts, "mesh_shape": (world,), "axis_roles": (T,)}
    if layout == "pp":
        return {
            **opts,
            "mesh_shape": (world // 2,),
            "pipeline_stages": 2,
            "schedule": schedule,
            "micro_batches": k,
        }
    raise ValueError(layout)


def first_line(tb: str) -> str:
    lines = [ln for ln in tb.strip().splitlines() if ln and not ln.startswith(" ")]
    return (lines[-1] if lines else tb)[:200]


# ----------------------------------------------------------------------------------------- ranks


def _autopar_runner(name, size, world, path, optimizer, feed: str = "slices") -> refs.Runner:
    model, inputs = refs.build(name, size)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    pm = autopar.autoparallelize(model, cluster, inputs, plan=path)
    opt = pm.optimizer(refs.optimizer_class(optimizer), lr=refs.LR)
    if feed == "slices" and pm.data_world > 1 and not pm.plan.pipeline.enabled:
        # each data-parallel rank its own rows, as the references are fed (module docstring)
        inputs = refs._rows(inputs, pm.data_rank, pm.data_world)
    if pm.plan.pipeline.enabled:
        # a Hugging Face model's loss is its output's ``.loss``, step's default; the MLP's the first
        # of its outputs
        loss_fn = None if hasattr(model, "config") else refs._loss

        def step():
            loss = pm.step(**inputs, loss_fn=loss_fn)
            opt.step()
            opt.zero_grad()
            return loss.detach()

        return refs.Runner(step)
    return refs.Runner(lambda: train_step(pm, opt, inputs))


def _time(runners: dict, rounds: int, steps: int) -> dict[str, list[float]]:
    """Seconds per step of each runner per round (the slowest rank's), interleaved (docstring)."""
    times: dict[str, list[float]] = {n: [] for n in runners}
    names = list(runners)
    for r in range(1 + rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            runners[n].step()  # untimed: the caches and allocator as this side leaves them
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                runners[n].step()
            t = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if r > 0:
                times[n].append(float(t))
    return times


def compare_once(name, size, layout, world, path, optimizer, cut, schedule, k, feed: str = "slices") -> dict:
    """Both sides built, the first step's losses (whole batch): {"autopar", "reference"} runners
    and losses, or {"na": why}."""
    ref = refs.reference(layout, name, size, optimizer, cut=cut, schedule=schedule, k=k)
    if isinstance(ref, str):
        return {"na": f"reference: {ref}"}
    ours = _autopar_runner(name, size, world, path, optimizer, feed)
    losses = (ours.global_loss(ours.step()), ref.global_loss(ref.step()))
    return {"runners": {"autopar": ours, "reference": ref}, "losses": losses}


def _rank(
    rank: int,
    world: int,
    jobs: list,
    optimizer: str,
    rounds: int,
    steps: int,
    schedule: str,
    k: int,
    feed: str,
):
    results = {}
    for key, path, cut in jobs:
        name, size, layout = key
        try:
            got = compare_once(name, size, layout, world, path, optimizer, cut, schedule, k, feed)
            if "na" in got:
                results[key] = got
                continue
            a, b = got["losses"]
            res = {"losses": (a, b)}
            if abs(a - b) <= RTOL * abs(b):
                res["times"] = _time(got["runners"], rounds, steps)
            results[key] = res
        except Exception:  # noqa: BLE001 - reported in the table
            results[key] = {"error": traceback.format_exc()}
        finally:
            got = None
            gc.collect()
    return results


# ---------------------------------------------------------------------------------------- parent


def plan_jobs(names, sizes, layouts, world, optimizer, schedule, k, tmp: Path) -> tuple[list, dict]:
    """(jobs for the ranks, cells already decided: plans that raised)."""
    jobs, cells = [], {}
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    for name in names:
        for size in sizes:
            for layout in layouts:
                key = (name, size, layout)
                if layout == "pp" and world % 2:
                    cells[key] = f"n/a: 2 pipeline stages need an even world, not {world}"
                    continue
                model, inputs = refs.build(name, size)
                try:
                    plan = autopar.plan(
                        model, cluster, inputs, **plan_options(layout, world, optimizer, schedule, k)
                    )
                except Exception:  # noqa: BLE001 - reported in the table
                    cells[key] = f"n/a: autopar: {first_line(traceback.format_exc())}"
                    continue
                path = tmp / f"{name}_{size}_{layout}_{world}.json"
                plan.save(path)
                cut = plan.pipeline.cuts[0] if plan.pipeline.enabled else 0
                jobs.append((key, str(path), cut))
    return jobs, cells


def cell(res: dict) -> tuple[str, str, str]:
    """(autopar ms, reference ms, ratio (spread) or what went wrong)."""
    if "na" in res:
        return "", "", f"n/a: {res['na']}"
    if "error" in res:
        return "", "", f"FAILED: {first_line(res['error'])}"
    a, b = res["losses"]
    if "times" not in res:
        return "", "", f"**LOSS MISMATCH**: autopar {a:.6g}, reference {b:.6g}"
    ta, tb = res["times"]["autopar"], res["times"]["reference"]
    per = [x / y for x, y in zip(ta, tb)]
    ma, mb = statistics.median(ta), statistics.median(tb)
    return f"{ma * 1e3:.1f}", f"{mb * 1e3:.1f}", f"{ma / mb:.2f} ({min(per):.2f}-{max(per):.2f})"


def merged(per_rank: list[dict]) -> dict:
    """Rank 0's result of a configuration, or the error of a rank that raised: the first that did
    not merely time out waiting for another (its traceback says what went wrong)."""
    errors = [r for r in per_rank if "error" in r]
    own = [r for r in errors if "imed out" not in r["error"] and "timeout" not in r["error"]]
    return (own or errors or per_rank)[0]


REFERENCE = {
    "eager": "eager",
    "ddp": "DistributedDataParallel",
    "zero2": "FSDP2, reshard_after_forward=False",
    "zero3": "FSDP2",
    "tp": "parallelize_module (Megatron)",
    "tp_sp": "parallelize_module (Megatron + SequenceParallel)",
    "pp": "pipelining, hand split",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--world", type=int, action="append", help="world size of the parallel layouts (repeatable)"
    )
    ap.add_argument("--models", default=",".join(refs.FAMILIES), help="of: " + ", ".join(refs.FAMILIES))
    ap.add_argument("--sizes", default=",".join(refs.SIZES), help="of: " + ", ".join(refs.SIZES))
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="of: " + ", ".join(LAYOUTS))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    ap.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument(
        "--feed",
        choices=("slices", "whole"),
        default="slices",
        help="autopar's data-parallel ranks are fed their own rows, as the references are (slices), "
        "or the whole batch, which the module slices (whole)",
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 2 rounds of 2 steps")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds for one world's spawn")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.rounds, args.steps = "tiny", 2, 2
    names, sizes, layouts = (a.split(",") for a in (args.models, args.sizes, args.layouts))
    unknown = [x for x in names if x not in refs.FAMILIES] + [x for x in sizes if x not in refs.SIZES]
    unknown += [x for x in layouts if x not in LAYOUTS]
    if unknown:
        ap.error(f"unknown model, size or layout: {unknown}")
    os.environ.setdefault(PRELOAD_ENV, "transformers")
    k = args.micro_batches
    # the one-rank layout runs in a spawn of its own, world 1
    worlds = ([1] if "eager" in layouts else []) + [w for w in (args.world or [2]) if w > 1]
    rows, errors = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            lay = [x for x in layouts if (x == "eager") == (world == 1)]
            if not lay:
                continue
            t0 = time.perf_counter()
            jobs, cells = plan_jobs(names, sizes, lay, world, args.optimizer, args.schedule, k, Path(tmp))
            print(f"world {world}: planned {len(jobs)} in {time.perf_counter() - t0:.0f} s", flush=True)
            try:
                per_rank = run_on_ranks(
                    _rank, world, jobs, args.optimizer, args.rounds, args.steps, args.schedule, k, args.feed,
                    timeout_s=args.timeout,
                )  # fmt: skip
                results = {key: merged([r[key] for r in per_rank]) for key, _, _ in jobs}
            except RankFailed as e:
                results = {key: {"error": str(e)} for key, _, _ in jobs}
            print(f"world {world}: ran in {time.perf_counter() - t0:.0f} s", flush=True)
            for name in names:
                for size in sizes:
                    for layout in lay:
                        key = (name, size, layout)
                        got = ("", "", cells[key]) if key in cells else cell(results[key])
                        if "error" in results.get(key, {}):
                            errors.append((key, world, results[key]["error"]))
                        rows.append((name, size, layout, world, REFERENCE[layout], *got))
    print(
        f"\ntorch {torch.__version__}, gloo on CPU, {args.optimizer}, {args.rounds} rounds of {args.steps} steps, "
        f"autopar fed {args.feed}; "
        f"pp: {args.schedule}, {k} micro-batches. ratio: autopar / reference, median (least-greatest per round)\n"
    )
    print("| model | size | layout | world | reference | autopar ms | reference ms | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")
    for key, world, tb in errors:
        print(f"\n{' '.join(key)} world {world} failed:\n" + "\n".join(tb.strip().splitlines()[-12:]))
    bad = [r for r in rows if "MISMATCH" in r[-1] or "FAILED" in r[-1]]
    if bad:
        print(f"\n{len(bad)} configuration(s) FAILED or computed a different loss: see the table", flush=True)


if __name__ == "__main__":
    main()
