"""How well does the cost model predict what runs? Predicted vs measured step time and peak memory.

For 3 models x 3 plans (DP, TP, auto; and mixed, a 2-axis mesh with data parallelism on axis 0
and tensor parallelism on axis 1, on world sizes that have one) x gloo world sizes 2 and 4: plan with a calibrated
ClusterSpec (``calibrate`` once at the start, or ``--cluster FILE``), run the plans of a model on local gloo
processes (SGD steps) in interleaved rounds (in an order shuffled per round, each plan one
untimed step before its timed ones: ``time_interleaved``), measure the step time (median over
rounds of the slowest rank's step) and the peak live tensor bytes (max over ranks, least of ``MEMORY_STEPS``
steps), and print predicted vs measured with relative errors; then the median
absolute error of each and whether the predicted ranking of the plans matches the measured one
(a plan that two roles find alike, e.g. auto = TP, is ranked once: the two runs of one plan differ
only by noise).

``--calibrate-each`` brackets each model's runs with calibrations, one before (which the plans
are searched with) and one after (the next model's before), and predicts each plan's step as the
mean of its prices under the two (``autopar.reprice``: the same decisions): the VM's pace drifts
by 10-40% within minutes, and a calibration on one side of the runs only catches half of that.

Each model's rounds also time a pace reference, ``REF_COUNT`` forward GEMMs of ``REF_GEMM`` on every
rank, which the calibrations price as ``_ref_predicted`` does: its error says how fast the VM ran
during the model's runs against during its calibrations. The reference has an error of its own
(a GEMM loop on one buffer runs ~10% faster than the calibration's GEMMs in a step), the same for
every model of a world size, so the summary gives, besides the plain median, the median with each
prediction scaled by its model's reference error relative to the median reference error of its
world size: a diagnostic of how much of the error is the VM's drift, not a figure of the cost
model's.

``--save DIR`` keeps the run (the plans, the calibrations that price them, the measurements);
``--replay DIR`` measures nothing and prices the saved plans again with the saved calibrations and
the code as it is now: two cost models compared on the same runs, free of the VM's noise between
runs (which moves the median error by several points).

``--profile`` plans with ``autopar.tools.profiler`` (ops timed on this CPU with one thread, as the
gloo ranks run them, cached in ``--profile-cache``) instead of the analytical compute model.

    .venv/bin/python benchmarks/bench_cost_accuracy.py [--cluster cluster.json | --calibrate-each]
        [--worlds 2 4] [--profile [--profile-cache PATH]] [--save DIR]
    .venv/bin/python benchmarks/bench_cost_accuracy.py --replay DIR

The DP plan is the search's plan with the data role (``AxisRole.DATA``: the batch split through
every op, the weights whole, their gradients all-reduced in buckets).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.cost_model.compute import forward_body
from autopar.demo import train_step
from autopar.launch import run_on_ranks
from autopar.model_spec import load_model_spec
from autopar.passes.solver import mesh_candidates
from autopar.tools.calibrate import run_calibration
from autopar.tools.measure import least_peak_step_memory, time_interleaved
from autopar.tools.profiler import OpProfiler

MODELS = {
    "mlp": "autopar.examples:mlp(batch=64, hidden=512, ffn=2048)",
    "gpt2_tiny": "autopar.examples:gpt2_tiny(batch=8, seq=64, hidden=128, vocab=512)",
    "llama_tiny": "autopar.examples:llama_tiny(batch=8, seq=64, hidden=128, vocab=512)",
}
WARMUP = 2  # untimed rounds (first-call allocations, autograd graph caches)
# steps timed back to back per round, as a training loop runs them: ranks leave a barrier up to
# ~2 ms apart on gloo, and one step after a barrier would charge that skew to the step
STEPS_PER_ROUND = 4
# plans predicted closer than this are a tie for the model (its median error is about this size)
RANK_MARGIN = 0.10
# tracked steps per plan; memory is the least of them (``least_peak_step_memory``: gloo's worker
# thread may hold a collective's tensors past their last use; tests/test_memory_model.py does the same)
MEMORY_STEPS = 3
RUN_FILE = "run.json"  # what --save writes into its folder and --replay reads
HEAD = (
    f"{'model':<11} {'world':>5} {'plan':<5} {'mesh':<7} {'pred ms':>9} {'meas ms':>9} {'err':>7} "
    f"{'pred MiB':>9} {'meas MiB':>9} {'err':>7}   pred ms per calibration"
)
# the pace reference (module docstring): forward GEMMs m x k x n, fp32, that a calibration prices well
REF_GEMM = (256, 512, 512)
REF_COUNT = 8
REF = "_ref"  # its key among a record's measurements
PLANS = {
    "DP": (autopar.AxisRole.DATA,),
    "TP": (autopar.AxisRole.TENSOR,),
    "auto": None,
    "mixed": (autopar.AxisRole.DATA, autopar.AxisRole.TENSOR),  # where the world has a 2-axis mesh
}


def _rank_run(
    rank: int, world: int, model_spec: str, cluster_dict: dict, plan_paths: dict, rounds: int
) -> dict:
    """Every plan of one model, timed in interleaved rounds: a slow spell of the shared machine
    hits every plan alike instead of whichever plan ran during it. A round runs
    ``STEPS_PER_ROUND`` steps back to back; its time per step is the slowest rank's; each plan's
    figure is the median over rounds after a warm-up. Memory: the least of ``MEMORY_STEPS`` tracked steps per plan."""
    cluster = autopar.ClusterSpec.from_dict(cluster_dict)
    runs = {}
    for name, path in plan_paths.items():
        torch.manual_seed(0)
        model, inputs = load_model_spec(model_spec)
        pmodel = autopar.autoparallelize(model, cluster, inputs, plan=path)
        opt = torch.optim.SGD(pmodel.parameters(), lr=0.01)
        runs[name] = (pmodel, lambda m=pmodel, o=opt, x=inputs: train_step(m, o, x))  # noqa: E731
    m, k, n = REF_GEMM
    a, b, c = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)

    def reference() -> None:
        for _ in range(REF_COUNT):
            torch.mm(a, b, out=c)

    steps = {name: step for name, (_, step) in runs.items()}
    times = time_interleaved({**steps, REF: reference}, rounds, WARMUP, STEPS_PER_ROUND)
    out = {REF: (times[REF], 0.0)}
    for name, (pmodel, step) in runs.items():
        out[name] = (times[name], least_peak_step_memory(pmodel, step, MEMORY_STEPS, dist.barrier))
    return out


def _ref_predicted(cluster: autopar.ClusterSpec) -> float:
    """Seconds the pace reference takes by the cost model's roofline, on ranks that share cores
    as the cluster's do."""
    m, k, n = REF_GEMM
    dev = cluster.device
    one = forward_body(2 * m * k * n, 4 * (m * k + k * n + m * n), torch.float32, dev, 1, min(m, k, n))
    return REF_COUNT * (one + dev.kernel_launch_s) * cluster.compute_slowdown


def _rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default=None, help="a calibrated spec file (default: calibrate now)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument(
        "--calib-world",
        type=int,
        default=None,
        help="one calibration on this many ranks for every world size "
        "(default: calibrate on each world size's own ranks, as a user of that many ranks would)",
    )
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds per plan (interleaved)")
    ap.add_argument(
        "--calibrate-each",
        action="store_true",
        help="calibrate again around each model's runs, before and after (the after of one model is "
        "the before of the next), and predict with both: on a shared VM the compute and the "
        "collectives drift by 10-40%% within minutes, and this keeps calibration and measurement "
        "together",
    )
    ap.add_argument("--profile", action="store_true", help="plan with measured op times (OpProfiler)")
    ap.add_argument("--profile-cache", default=None, help="op timing cache (default: ~/.cache/autopar/)")
    ap.add_argument(
        "--save", default=None, help="write the run (plans, calibrations, measurements) to this folder"
    )
    ap.add_argument(
        "--replay",
        default=None,
        help="measure nothing: price the plans of a run saved with --save again, with its "
        "calibrations and this code, against its measurements (to compare cost models on the same runs)",
    )
    args = ap.parse_args()
    if args.replay:
        records = json.loads((Path(args.replay) / RUN_FILE).read_text())
        _report(records, Path(args.replay), args.profile, args.profile_cache)
        return
    out = Path(args.save) if args.save else Path(tempfile.mkdtemp(prefix="bench_cost_"))
    out.mkdir(parents=True, exist_ok=True)
    records = _measure(args, out)
    if args.save:
        (out / RUN_FILE).write_text(json.dumps(records, indent=1))
        print(f"saved the run to {out / RUN_FILE} (price it again: --replay {out})")


def _measure(args, out: Path) -> list[dict]:
    """Plan and run every model on every world size; print each model's rows as its runs end.
    Returns one record per (world, model): its plans' files, the calibrations that price them,
    the measurements."""
    calibrated: dict[int, autopar.ClusterSpec] = {}

    def cluster_for(world: int, fresh: bool = False) -> autopar.ClusterSpec:
        """The spec a user of ``world`` local ranks would plan with: a file, or a calibration."""
        if args.cluster:
            base = autopar.ClusterSpec.from_file(args.cluster)
        else:
            n = args.calib_world or world  # default: calibrate on the ranks that will run
            if n not in calibrated or fresh:
                t0 = time.perf_counter()
                cal = run_calibration(n)
                calibrated[n] = cal.cluster
                print(f"calibrated on {n} gloo processes in {time.perf_counter() - t0:.1f} s")
                print(cal.table())
            base = calibrated[n]
        dev = base.device
        print(
            f"spec: link {base.intra_node.bandwidth / 1e9:.3f} GB/s + {base.intra_node.latency * 1e6:.1f} us, "
            f"peak fp32 {dev.peak_flops_for('float32') / 1e9:.1f} GFLOP/s, mem {dev.memory_bandwidth / 1e9:.1f} GB/s, "
            f"launch {dev.kernel_launch_s * 1e6:.2f} us, host cores {dev.contention.host_cores if dev.contention else 0}\n"
        )
        return base.with_overrides(nodes=1, devices_per_node=world)

    bracket = args.calibrate_each and not args.cluster
    records: list[dict] = []
    priced: list[dict] = []  # each record's prices (``_price``), for its rows and the summary
    for world in args.worlds:
        cluster = cluster_for(world)
        profiler = OpProfiler.for_cluster(cluster, cache_path=args.profile_cache) if args.profile else None
        print(f"compute: {'profiled, ' + profiler.cache.context if profiler else 'analytical (roofline)'}")
        print(HEAD)
        for mname in args.models:
            spec = MODELS[mname]
            paths = {}
            for pname, roles in PLANS.items():
                if roles and not any(len(m) == len(roles) for m in mesh_candidates(world, len(roles), world)):
                    continue  # no mesh of that many axes (mixed on 2 ranks)
                model, inputs = load_model_spec(spec)
                try:
                    plan = autopar.plan(
                        model,
                        cluster,
                        inputs,
                        axis_roles=roles,
                        optimizer=autopar.Optimizer.SGD,
                        profile=profiler or False,
                    )
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"{mname:<11} {world:>5} {pname:<5} plan failed: {type(e).__name__}: {e}")
                    continue
                paths[pname] = f"{mname}_{world}_{pname}.json"  # in ``out``
                plan.save(out / paths[pname])
            files = {p: str(out / name) for p, name in paths.items()}
            results = run_on_ranks(_rank_run, world, spec, cluster.to_dict(), files, args.rounds)
            clusters = [cluster.to_dict()]
            if bracket:  # the calibration right after the runs, which the next model plans with
                cluster = cluster_for(world, fresh=True)
                clusters.append(cluster.to_dict())
            record = {
                "model": mname,
                "spec": spec,
                "world": world,
                "plans": paths,
                "clusters": clusters,
                "measured": {p: [max(r[p][i] for r in results) for i in (0, 1)] for p in [*paths, REF]},
            }
            records.append(record)
            priced.append(_price(record, out, args.profile, args.profile_cache))
            _print_rows(record, priced[-1])
    print()
    _summary(records, priced)
    return records


def _report(records: list[dict], folder: Path, profile: bool, profile_cache) -> None:
    """Every record's rows (``_price``, ``_print_rows``), then the summary (``_summary``)."""
    priced = []
    for i, rec in enumerate(records):
        if i == 0 or records[i - 1]["world"] != rec["world"]:
            print(HEAD)
        priced.append(_price(rec, folder, profile, profile_cache))
        _print_rows(rec, priced[-1])
    _summary(records, priced)


def _price(rec: dict, folder: Path, profile: bool, profile_cache) -> dict:
    """Each of the record's plans priced with each of its calibrations (``autopar.reprice``: the
    plan's decisions, unchanged): ``{"plans": {name: (plan, [step s per calibration], peak
    bytes)}, "ref": [the pace reference's s per calibration]}`` (no ``ref`` in runs saved before it)."""
    clusters = [autopar.ClusterSpec.from_dict(c) for c in rec["clusters"]]
    profiler = OpProfiler.for_cluster(clusters[0], cache_path=profile_cache) if profile else None
    out: dict = {"plans": {}}
    for pname, name in rec["plans"].items():
        plan = autopar.Plan.load(folder / name)
        priced = []
        for cl in clusters:
            model, inputs = load_model_spec(rec["spec"])
            priced.append(
                autopar.reprice(
                    model, cl, inputs, plan, optimizer=autopar.Optimizer.SGD, profile=profiler or False
                )
            )
        steps = [p.predicted.step_time_s for p in priced]
        out["plans"][pname] = (
            plan,
            steps,
            priced[0].predicted.peak_memory_bytes,
        )  # memory: the same with each
    if REF in rec["measured"]:
        out["ref"] = [_ref_predicted(cl) for cl in clusters]
    return out


def _print_rows(rec: dict, priced: dict) -> None:
    """Predicted (the mean over the calibrations) against measured, per plan, and the pace reference."""
    for pname, (plan, steps, pred_m) in priced["plans"].items():
        pred_t = statistics.mean(steps)
        meas_t, meas_m = rec["measured"][pname]
        each = " / ".join(f"{t * 1e3:.3f}" for t in steps)
        print(
            f"{rec['model']:<11} {rec['world']:>5} {pname:<5} {'x'.join(map(str, plan.mesh_shape)):<7} "
            f"{pred_t * 1e3:>9.3f} {meas_t * 1e3:>9.3f} {_rel(pred_t, meas_t) * 100:>6.0f}% "
            f"{pred_m / 2**20:>9.2f} {meas_m / 2**20:>9.2f} {_rel(pred_m, meas_m) * 100:>6.0f}%   {each}",
            flush=True,
        )
    if "ref" in priced:
        pred, meas = statistics.mean(priced["ref"]), rec["measured"][REF][0]
        print(
            f"{'':<11} {rec['world']:>5} {'ref':<5} {'':<7} {pred * 1e3:>9.3f} {meas * 1e3:>9.3f} "
            f"{_rel(pred, meas) * 100:>6.0f}%   (pace reference: {REF_COUNT} GEMMs {'x'.join(map(str, REF_GEMM))})"
        )


def _summary(records: list[dict], priced: list[dict]) -> None:
    """The median errors over every plan of every record, and the rankings."""
    rows, ranked, paced = [], [], []
    for rec, pr in zip(records, priced):
        # the reference's predicted over measured (runs saved before it have none)
        pace = statistics.mean(pr["ref"]) / rec["measured"][REF][0] if "ref" in pr else None
        case = {}
        for pname, (_, steps, pred_m) in pr["plans"].items():
            pred_t = statistics.mean(steps)
            meas_t, meas_m = rec["measured"][pname]
            case[pname] = (pred_t, meas_t)
            rows.append((_rel(pred_t, meas_t), _rel(pred_m, meas_m)))
            if pace is not None:
                paced.append((rec["world"], pace, pred_t, meas_t))
        # a plan the search found twice (auto = TP) is one plan: ranked once, under both names
        plans = {p: plan for p, (plan, _, _) in pr["plans"].items()}
        ranked.append((rec["model"], rec["world"], {"=".join(n): case[n[0]] for n in _same_plans(plans)}))
    print(
        f"median |error| step time:   {statistics.median(abs(r[0]) for r in rows) * 100:.0f}%  ({len(rows)} cases)"
    )
    if paced and len(paced) == len(rows):
        # the reference's own error, the same for every model of a world size: its median there
        usual = {w: statistics.median(p for v, p, _, _ in paced if v == w) for w, *_ in paced}
        errs = [_rel(pred / (pace / usual[w]), meas) for w, pace, pred, meas in paced]
        print(
            f"  each prediction scaled by its model's pace reference, relative to its world size's "
            f"median (the VM's drift; a diagnostic): {statistics.median(abs(e) for e in errs) * 100:.0f}%"
        )
    print(f"median |error| peak memory: {statistics.median(abs(r[1]) for r in rows) * 100:.0f}%")
    print("ranking of the plans (fastest first), predicted vs measured:")
    agree = pairs = ordered = 0
    for mname, world, case in ranked:
        pred = sorted(case, key=lambda k: case[k][0])
        meas = sorted(case, key=lambda k: case[k][1])
        ok = pred == meas
        agree += ok
        # pairs the model tells apart (predictions RANK_MARGIN or more apart): measured in that order?
        calls = []
        for a, b in itertools.combinations(case, 2):
            (pa, ma), (pb, mb) = case[a], case[b]
            if abs(pa - pb) >= RANK_MARGIN * min(pa, pb):
                pairs += 1
                good = (pa < pb) == (ma < mb)
                ordered += good
                calls.append(f"{a}{'<' if pa < pb else '>'}{b} {'ok' if good else 'WRONG'}")
        print(f"  {mname:<11} world {world}: predicted {' < '.join(pred):<18} measured {' < '.join(meas):<18} "
              f"{'match' if ok else 'differs'}; pairs apart by >= {RANK_MARGIN:.0%}: {', '.join(calls) or 'none'}")  # fmt: skip
    print(f"rankings that match exactly: {agree}/{len(ranked)}")
    print(f"plan pairs predicted >= {RANK_MARGIN:.0%} apart and measured in that order: {ordered}/{pairs}")


def _same_plans(plans: dict) -> list[list[str]]:
    """Plan names grouped by identical plans (mesh and every node's placements), in order."""
    groups: dict[tuple, list[str]] = {}
    for name, plan in plans.items():
        key = (plan.mesh_shape, tuple((d.name, d.output, d.inputs) for d in plan.decisions))
        groups.setdefault(key, []).append(name)
    return list(groups.values())


if __name__ == "__main__":
    main()
