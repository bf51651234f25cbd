"""The search: one function of named stages, each a function of the previous stage's output.

    trace -> analyze -> coarsen -> for each mesh candidate: strategies -> cost
          -> for each rung of the trades ladder: solve -> select -> price

* ``trace``: the model as an aten-level FX graph (``passes/trace.py``), outputs the plan does not
  return dropped and fused kernels substituted (``fuse_stage``, ``passes/fuse.py``);
* ``analyze``: shapes, FLOPs, bytes, roles per node (``passes/analyze.py``);
* ``coarsen``: repeated-block twins share their ILP variables (``passes/coarsen.py``);
* ``candidates``: the meshes (and axis roles) to try, SPMD and per pipeline stage count
  (``passes/candidates.py``); for each, ``strategies`` and ``cost`` (its strategy and cost
  tables, ``passes/candidate_tables.py``), built one candidate ahead on a worker thread
  (``passes/prefetch.py``);
* ``trades``: per candidate, down the memory-for-time trades ladder (``passes/ladder.py``: ZeRO
  stage, recomputation, micro-batches, offload, at the plan's precision), each rung the same ILP on
  transformed tables, priced as the candidate's kind prices it (``passes/rungs.py``), skipped
  without a solve where its memory lower bound passes the limit or a rung with at least as much
  room each way had no plan, the first that fits taken;
* ``solve``: one rung of one candidate (``passes/mesh_solve.py:solve_mesh``: memory lower bound,
  time lower bound against the best so far, the ILP of ``passes/solver.py`` pruned where its LP
  relaxation passes the best so far, then the chosen solution's gradient buckets and full peak);
  its outcome is typed (``passes/outcome.py``);
* ``select``: the candidate with the smallest predicted step, or the error that says why none fits;
* ``price``: the chosen solution priced as it runs (``passes/solved_plan.py:price_solved``).

Every stage can be dumped (``dump_dir``, or the ``AUTOPAR_DUMP_DIR`` environment variable,
``passes/dumps.py``): ``1_trace.py``, ``2_analyze.tsv``, ``2_coarsen.tsv``, per mesh
``3_strategies_<mesh>.tsv`` and ``3_costs_<mesh>.tsv``, ``4_solve_<mesh>.json``,
``5_select.json``, ``6_plan.json``. The options the search obeys are one frozen
``autopar.options.SearchOptions``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from autopar.cluster import ClusterSpec
from autopar.errors import NoPlanFitsError
from autopar.options import SearchOptions
from autopar.passes.analyze import NodeInfo, analyze
from autopar.passes.blocks import find_blocks
from autopar.passes.candidate_tables import data_parallel_axis
from autopar.passes.candidates import MeshRun, spmd_runs, stage_runs
from autopar.passes.coarsen import find_classes
from autopar.passes.costs import NodeTimer
from autopar.passes.dumps import Stages, classes_tsv, infos_tsv
from autopar.passes.experts import has_experts, mark_nodes, mark_skew
from autopar.passes.fuse import chosen_kernels, fuse
from autopar.passes.grad_sync import walked_once
from autopar.passes.mesh_solve import Solved
from autopar.passes.micro_batch_check import MicroBatchCheck
from autopar.passes.no_fit import no_fit_message
from autopar.passes.outcome import Entry, Verdict
from autopar.passes.pipeline import stage_counts
from autopar.passes.precision import auto_precision, autocast_device, half_infos
from autopar.passes.prefetch import Prefetcher
from autopar.passes.rungs import pipeline_climb, spmd_climb
from autopar.passes.search_problem import Found, Problem
from autopar.passes.solved_plan import price_solved, with_pipeline, with_trades
from autopar.passes.solver import memory_binds
from autopar.passes.strategies import Strategy, variable_nodes
from autopar.passes.trace import TracedGraph, keep_loss_only, trace
from autopar.passes.trades import batch_size
from autopar.placement import ExpertDispatch, Outputs
from autopar.plan import Plan

# names other modules import from here; each lives in the module of its idea
__all__ = [
    "GC_GEN0_THRESHOLD",
    "MeshRun",
    "SearchResult",
    "Solved",
    "data_parallel_axis",
    "no_fit_message",
    "search",
    "with_pipeline",
    "with_trades",
]


@dataclass
class SearchResult:
    plan: Plan
    traced: TracedGraph
    choice: dict[str, Strategy]


def search(
    model: torch.nn.Module,
    cluster: ClusterSpec,
    example_inputs,
    options: SearchOptions | None = None,
    *,
    profiler: NodeTimer | None = None,
    progress: Callable[[str], None] | None = None,
    dump_dir: str | os.PathLike | None = None,
) -> SearchResult:
    """Search the plan for ``model`` on ``cluster`` under ``options`` (module docstring).
    ``profiler``: prices ops by running them (``autopar.tools.profiler``), else the roofline."""
    options = options or SearchOptions()
    st = Stages(progress, dump_dir)
    with _young_garbage_only() as freeze:
        return _search(model, cluster, example_inputs, options, profiler, st, freeze)


# the search allocates millions of short-lived objects (ILP rows, cost tables); at CPython's
# default gen-0 threshold (700) the collector runs every few hundred of them and, every hundred
# runs, walks every object alive (the traced graph, the model, torch's own): a fifth of the
# search's time on the 8B-on-64 plan (benchmarks/README.md, "Planning time at scale")
GC_GEN0_THRESHOLD = 20_000


@contextlib.contextmanager
def _young_garbage_only():
    """During the search: the collector run less often, and a ``freeze`` that takes what is alive
    once the model is traced (the model, its graph, torch's state) out of its full passes; on
    exit its settings as they were and those objects handed back (``gc.unfreeze``). Where the
    caller keeps objects frozen itself, nothing is frozen (unfreezing would take its own too).
    The search's own cycles are still collected."""
    was = gc.get_threshold()
    ours = gc.get_freeze_count() == 0
    gc.set_threshold(max(was[0], GC_GEN0_THRESHOLD), *was[1:])
    try:
        yield gc.freeze if ours else (lambda: None)
    finally:
        gc.set_threshold(*was)
        if ours:
            gc.unfreeze()


def _search(
    model, cluster, example_inputs, options: SearchOptions, profiler, st: Stages, freeze: Callable[[], None]
) -> SearchResult:
    tg = trace_stage(model, example_inputs, st)
    mark_skew(tg, options.expert_skew)  # the routing skew the MoE ops are priced at
    # where an expert axis spans nodes: the dispatch once per node (unless the flat one is forced)
    mark_nodes(tg, None if options.expert_dispatch is ExpertDispatch.ALL_TO_ALL else cluster.devices_per_node)
    freeze()  # what is alive now lives through the search: out of the collector's full passes
    micro = MicroBatchCheck(model, example_inputs, tg, options.micro_batches, st.say)
    fuse_stage(tg, cluster, options, st)
    infos = analyze_stage(tg, st)
    classes = coarsen_stage(tg, infos, options, st)
    precision = options.precision or auto_precision(infos)
    pb = Problem(
        tg=tg, infos=infos, classes=classes, blocks=find_blocks(tg), cluster=cluster, options=options,
        precision=precision, batch=batch_size(tg, infos), limit=cluster.memory_limit(options.memory_limit_bytes),
        # what the cost model prices: values in the dtypes they are computed in
        cinfos=half_infos(tg, infos, precision, autocast_device(cluster)),
        profiler=profiler, st=st, micro=micro, model=model, example_inputs=example_inputs,
    )  # fmt: skip
    with walked_once(tg):  # the graph's structure, as every solution's gradient sync reads it
        found = explore(pb)
        # one-row micro-batches are explored unchecked (tracing the model on one row costs as much
        # as the first trace); only where a plan with them wins is the model traced on one row.
        # Where its graph changes there, the search runs again without them: that plan may have
        # pruned others
        while found.best is not None and not micro.allows(pb.batch, _micro_batches_of(found.best)):
            st.say("search: again, without one-row micro-batches")
            found = explore(pb)
        best = select_stage(found, pb)
        plan = price_stage(pb, best, found.candidates)
    return SearchResult(plan, tg, best.choice)


def explore(pb: Problem) -> Found:
    """Every candidate: the SPMD meshes (``passes/candidates.py:mesh_runs``), each down its ladder
    of trades, then each pipeline stage count's stage meshes, pruned against the fastest plan so
    far; per stage count, the fastest of its stage meshes competes with the rest."""
    found = Found()
    with Prefetcher(pb) as prefetch:
        deferred = []  # free candidates under a memory limit that binds: solved after the others
        plans: dict[tuple[int, ...], list[Solved]] = {}  # the plans found, by mesh
        for run, mirror in spmd_runs(pb.cluster, pb.options, has_experts(pb.tg)):
            if mirror is not None:
                found.candidates.append(Entry(run.mesh, Verdict.MIRROR, mirror_of=mirror))
                pb.st.say(f"solve: mesh {run.label}: the same problem as mesh {mirror} (axes permuted)")
                continue
            got = prefetch.take(run, pb.cluster)
            found.candidates.extend(got.candidates)
            found.unplaceable.extend(got.unplaceable)
            if got.tables is None:  # e.g. a batch of one: no data parallelism at all
                continue
            if run.roles is None and memory_binds(got.tables, pb.limit):
                deferred.append((run, got))
                continue
            _spmd(pb, run, got, found, plans)
        for run, got in deferred:
            _spmd(pb, run, got, found, plans)
        for stages in stage_counts(pb.cluster.world_size, len(pb.blocks), pb.options):
            sub, runs, why = stage_runs(pb.cluster, pb.options, stages, has_experts(pb.tg))
            if sub is None:
                pb.st.say(why)
                continue
            fastest: Solved | None = None
            for run in runs:
                got = prefetch.take(run, sub)
                found.candidates.extend(got.candidates)
                found.unplaceable.extend(got.unplaceable)
                if got.tables is None:
                    continue
                climbed = pipeline_climb(pb, run, sub, got.tables, found.objective)
                found.add(climbed)
                for solved in climbed.solved:
                    if fastest is None or solved.t_step < fastest.t_step:
                        fastest = solved
            if fastest is not None:
                found.offer(fastest)
    return found


def _spmd(pb: Problem, run: MeshRun, got, found: Found, plans: dict[tuple[int, ...], list[Solved]]) -> None:
    """SPMD candidate ``run`` (its tables ``got``) down its ladder, into ``found``.

    Where memory binds (``passes/solver.py:memory_binds``), ``explore`` climbs the free candidates
    after every data-parallel one: a data-parallel plan with ZeRO is then often the best, and its
    step prunes the free ILPs (larger, and their MIPs under memory rows the slowest solves of a
    search) by their LP relaxations. A 2-layer Gemma 2 on 4 cpu devices at 0.6 of its free plan's
    peak: its (4,) free MIP (6 s) and two recomputation rungs (5 s) pruned by the (2, 2)
    data-parallel plan (benchmarks/README.md, "Planning under a memory limit"). Without a binding
    limit the order stays: the free candidate's plan usually wins there and prunes the next mesh's.

    ``plans``: the plans found so far by mesh; those on ``run``'s mesh are the ILP's hints of a
    plan where its LP relaxation prunes a rung (``MeshProblem.hints``), and ``run``'s join them."""
    on_mesh = plans.setdefault(run.mesh, [])
    climbed = spmd_climb(pb, run, got, found.objective, tuple(s.choice for s in on_mesh))
    found.add(climbed)
    for solved in climbed.solved:
        found.offer(solved)
    on_mesh.extend(climbed.solved)


def _micro_batches_of(s: Solved) -> int:
    return s.pipe.micro_batches if s.pipe is not None else s.trades.micro_batches


# -- stages ----------------------------------------------------------------------------------------


def trace_stage(model: torch.nn.Module, example_inputs, st: Stages) -> TracedGraph:
    tg = trace(model, example_inputs, stack_traces=st.dump is not None)
    st.say(f"trace: {len(tg.graph.nodes)} nodes with {tg.tracer} ({time.perf_counter() - st.t0:.1f} s)")
    st.write("1_trace.py", tg.graph_module.code)
    return tg


def fuse_stage(tg: TracedGraph, cluster: ClusterSpec, options: SearchOptions, st: Stages) -> None:
    """Outputs the plan does not return dropped (``Outputs.LOSS``), then the fused kernels
    substituted (``passes/fuse.py``); the graph dumped again where anything changed."""
    if options.outputs is Outputs.LOSS:
        keep_loss_only(tg)
    tg.kernels = fuse(tg, chosen_kernels(cluster.device.kind, options.kernels))
    if tg.kernels:
        counts: dict[str, int] = {}
        for u in tg.kernels:
            counts[u.kernel.value] = counts.get(u.kernel.value, 0) + 1
        st.say("fuse: " + ", ".join(f"{k} x{n}" for k, n in counts.items()))
    if tg.kernels or options.outputs is Outputs.LOSS:
        st.write("1_fuse.py", tg.graph_module.code)


def analyze_stage(tg: TracedGraph, st: Stages) -> dict[str, NodeInfo]:
    infos = analyze(tg)
    if st.dump:
        st.write("2_analyze.tsv", infos_tsv(infos))
    return infos


def coarsen_stage(tg: TracedGraph, infos: dict[str, NodeInfo], options: SearchOptions, st: Stages):
    classes = find_classes(tg, infos, variable_nodes(tg)) if options.coarsen else None
    if classes is not None:
        st.say(f"coarsen: {len(classes.rep)} nodes in {len(classes.members)} classes")
        if st.dump:
            st.write("2_coarsen.tsv", classes_tsv(classes))
    return classes


def select_stage(found: Found, pb: Problem) -> Solved:
    """The candidate with the smallest predicted step (the search loop keeps it), or the error
    that says why none fits: the memory the best candidate needs, or, where no candidate could
    place the model under its axis roles, why not."""
    pb.st.write("5_select.json", json.dumps([c.to_dict() for c in found.candidates], indent=1, default=str))
    if found.best is None and found.min_needed == math.inf and found.unplaceable:
        raise NoPlanFitsError(
            "no plan: no candidate mesh can place the model; " + "; ".join(found.unplaceable)
        )
    infeasible = [c for c in found.candidates if c.verdict.infeasible]
    if found.best is None and infeasible and all(c.verdict is Verdict.BLOCKED for c in infeasible):
        reasons = list(dict.fromkeys(c.blocked for c in infeasible))
        raise NoPlanFitsError(
            "no plan: the axis roles cannot be honoured on any candidate: "
            + "; ".join(reasons[:3])
            + "; use AxisRole.AUTO on that axis (or another role), or change the model's op"
        )
    if found.best is None:
        raise NoPlanFitsError(no_fit_message(pb, found))
    return found.best


def price_stage(pb: Problem, best: Solved, candidates: list[Entry]) -> Plan:
    """The chosen solution priced as it runs (``price_solved``), with the candidates tried."""
    st = pb.st
    plan = price_solved(pb.tg, pb.cinfos, best, pb.cluster, pb.options, [c.to_dict() for c in candidates])
    if st.dump:
        plan.save(st.dump / "6_plan.json")
    st.say(f"plan: mesh {best.run.mesh}, {time.perf_counter() - st.t0:.1f} s in all")
    return plan
