"""The search: one function of named stages, each a function of the previous stage's output.

    trace -> analyze -> coarsen -> for each mesh candidate: strategies -> cost
          -> for each rung of the trades ladder: solve -> select -> price

* ``trace``: the model as an aten-level FX graph (``passes/trace.py``);
* ``analyze``: shapes, FLOPs, bytes, roles per node (``passes/analyze.py``);
* ``coarsen``: repeated-block twins share their ILP variables (``passes/coarsen.py``);
* ``candidates``: the meshes (and axis roles) to try (``mesh_runs``); for each,
  ``strategies`` (``passes/strategies.py``), ``cost`` (the cost tables, ``passes/costs.py``) and
  ``solve`` (``solve_mesh``: memory lower bound, time lower bound against the best so far, the ILP
  of ``passes/solver.py`` (pruned where its LP relaxation passes the best so far), then the
  chosen solution's gradient buckets and full peak, solving again once with less room when the
  buckets' flattening passes the limit);
* ``trades``: per candidate, the memory-for-time trades ladder (``passes/trades.py``: ZeRO stage,
  recomputation, micro-batches, offload, at the plan's precision), each rung the same ILP on
  transformed tables, skipped without a solve where its memory lower bound passes the limit or a
  rung with at least as much room each way had no plan, the first that fits taken;
* ``select``: the candidate with the smallest predicted step;
* ``price``: the chosen solution priced as it runs (``passes/price.py:price_plan``).

Every stage can be dumped (``dump_dir``, or the ``AUTOPAR_DUMP_DIR`` environment variable):
``1_trace.py``, ``2_analyze.tsv``, ``2_coarsen.tsv``, per mesh ``3_strategies_<mesh>.tsv`` and
``3_costs_<mesh>.tsv``, ``4_solve_<mesh>.json``, ``5_select.json``, ``6_plan.json``. The options
the search obeys are one frozen ``autopar.options.SearchOptions``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from autopar.cluster import ClusterSpec
from autopar.cost_model.comm import axis_link
from autopar.errors import NoPlanFitsError
from autopar.options import AxisRole, Optimizer, SearchOptions
from autopar.passes.analyze import NodeInfo, analyze
from autopar.passes.background import Gate, owning, working
from autopar.passes.blocks import Block, find_blocks
from autopar.passes.coarsen import Classes, find_classes
from autopar.passes.costs import CostTables, NodeTimer, build_costs
from autopar.passes.data_region import DataRegion, find_region, region_parts
from autopar.passes.fuse import chosen_kernels, fuse
from autopar.passes.grad_sync import GradSyncCost
from autopar.passes.infeasible import blocked
from autopar.passes.local_rows import trace_rows
from autopar.passes.memory_row import lower_bound_bytes
from autopar.passes.micro_batch_check import MicroBatchCheck
from autopar.passes.pipeline import (
    PipelinePrice,
    PipelineProblem,
    Regions,
    in_flight,
    micro_batch_counts,
    price_pipeline,
    stage_cluster,
    stage_counts,
    stage_tables,
)
from autopar.passes.price import buffers_inputs_bytes, expanded_choice, grad_sync_cost, plan_peak, price_plan
from autopar.passes.solver import (
    EXACT_FOLD_MAX_PAIRS,
    Pruned,
    Solution,
    edge_pairs,
    fold_followers,
    lower_bound,
    mesh_candidates,
    solve,
)
from autopar.passes.strategies import NodeStrategies, Strategy, build_strategies, variable_nodes
from autopar.passes.trace import Role, TracedGraph, keep_loss_only, trace
from autopar.passes.trades import (
    TradeTerms,
    apply_trades,
    auto_precision,
    autocast_device,
    batch_size,
    half_infos,
    ladder,
    micro_batch_ok,
    param_state,
    trade_terms,
    zero_axes,
)
from autopar.placement import Outputs, SeqAttention, is_shard, spec_to_str
from autopar.plan import Plan
from autopar.trades import Offload, Schedule, Trades, ZeroStage

log = logging.getLogger("autopar")

# meshes of up to this many axes are searched when no mesh shape or axis roles are given
MAX_MESH_AXES = 3
# in that search, a mesh of this many axes or more has its outer axis (the slowest links, across
# nodes when the mesh spans nodes) data parallel: every node's placement on it is fixed to the
# data-parallel solution of that axis alone, so the strategy tables are those of the other axes.
# Free, the tables of a 3-axis mesh grow as (options per axis)^6 per edge. A mesh_shape passed
# explicitly is searched without this restriction.
DATA_OUTER_MIN_AXES = 3
# per candidate mesh, how many trades rungs that fit are solved before the next mesh: the ladder
# puts the cheapest first (a later one can win where the first fits only with a worse placement,
# rarely: each solve of a large mesh costs seconds)
RUNGS_SOLVED = 1
# after this many rungs of one candidate had no plan, only rungs with more room every way than one
# of them are solved (each empty rung of a large mesh is a solve of seconds)
MAX_EMPTY_RUNGS = 4


@dataclass
class SearchResult:
    plan: Plan
    traced: TracedGraph
    choice: dict[str, Strategy]


@dataclass(frozen=True)
class MeshRun:
    """One candidate of the outer search: a mesh and its axis roles (None: free). ``data_outer``:
    its outer axis is pinned to the data-parallel solution of that axis alone
    (``DATA_OUTER_MIN_AXES``); ``data_first``: the search's own second try of a mesh of fewer axes
    with axis 0 data parallel. Either is skipped, like any candidate whose roles leave a tensor no
    placement (``_skip``)."""

    mesh: tuple[int, ...]
    roles: tuple[AxisRole, ...] | None
    data_outer: bool = False
    data_first: bool = False
    stages: int = 1  # pipeline stages: ``mesh`` is then one stage's mesh (passes/pipeline.py)

    @property
    def label(self) -> str:
        text = f"{self.mesh} (axis 0 data parallel)" if self.data_outer or self.data_first else f"{self.mesh}"
        return f"{text} x {self.stages} pipeline stages" if self.stages > 1 else text

    @property
    def tag(self) -> str:
        """The candidate in dump file names: ``2x4``, ``2x4_data``, ``2x4_pp8``."""
        return (
            "x".join(map(str, self.mesh))
            + ("_data" if self.data_first else "")
            + (f"_pp{self.stages}" if self.stages > 1 else "")
        )


@dataclass
class Solved:
    """A candidate the ILP solved: its predicted step (the tables' objective plus the gradient
    buckets' adjustment) and what pricing it needs."""

    t_step: float
    run: MeshRun
    sol: Solution
    tables: CostTables
    bound: float
    gs: GradSyncCost
    choice: dict[str, Strategy]
    trades: Trades = Trades()
    terms: TradeTerms | None = None
    pipe: PipelinePrice | None = None  # pipeline stages: their price (t_step is its step)
    cluster: ClusterSpec | None = None  # what the tables were priced on (one stage's devices)


class _Stages:
    """Progress lines and dumps of one search."""

    def __init__(self, progress: Callable[[str], None] | None, dump_dir):
        self.progress_fn = progress
        dump_dir = dump_dir or os.environ.get("AUTOPAR_DUMP_DIR")
        self.dump = Path(dump_dir) if dump_dir else None
        if self.dump:
            self.dump.mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()

    def say(self, msg: str) -> None:
        log.info(msg)
        if self.progress_fn is not None:
            self.progress_fn(msg)

    def write(self, name: str, text: str) -> None:
        if self.dump:
            (self.dump / name).write_text(text)


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
    st = _Stages(progress, dump_dir)
    with _young_garbage_only() as freeze:
        return _search(model, cluster, example_inputs, options, profiler, st, freeze)


# the search allocates millions of short-lived objects (ILP rows, cost tables); at CPython's
# default gen-0 threshold (700) the collector runs every few hundred of them and, every hundred
# runs, walks every object alive (the traced graph, the model, torch's own): a fifth of the
# search's time on the 8B-on-64 plan (benchmarks/README.md, "Planning time again")
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
    model, cluster, example_inputs, options: SearchOptions, profiler, st: _Stages, freeze: Callable[[], None]
) -> SearchResult:
    tg = trace_stage(model, example_inputs, st)
    freeze()  # what is alive now lives through the search: out of the collector's full passes
    micro = MicroBatchCheck(model, example_inputs, tg, options.micro_batches, st.say)
    fuse_stage(tg, cluster, options, st)
    infos = analyze_stage(tg, st)
    classes = coarsen_stage(tg, infos, options, st)
    blocks = find_blocks(tg)
    precision = options.precision or auto_precision(infos)
    # what the cost model prices: values in the dtypes they are computed in
    cinfos = half_infos(tg, infos, precision, autocast_device(cluster))
    batch = batch_size(tg, infos)
    limit = cluster.memory_limit(options.memory_limit_bytes)
    # found once, shared by every pass: the data-parallel solution of one axis, by size, and the
    # data-parallel regions by ranks on the data axis (or why there is none)
    pb = _Problem(
        tg, infos, cinfos, classes, blocks, cluster, options, precision, batch, limit, profiler, st, micro,
        {}, model, example_inputs, {},
    )  # fmt: skip
    found = _explore(pb)
    # one-row micro-batches are explored unchecked (tracing the model on one row costs as much as
    # the first trace); only where a plan with them wins is the model traced on one row. Where its
    # graph changes there, the search runs again without them: that plan may have pruned others
    while found.best is not None and not micro.allows(batch, _micro_batches_of(found.best)):
        st.say("search: again, without one-row micro-batches")
        found = _explore(pb)
    best, candidates = found.best, found.candidates
    best = select_stage(
        best, candidates, cluster, limit, found.min_needed, found.refused_at_full_peak, found.unplaceable, st,
        options,
    )  # fmt: skip
    plan = price_stage(tg, cinfos, best, cluster, options, candidates, st)
    return SearchResult(plan, tg, best.choice)


@dataclass
class _Found:
    """What one pass over the candidates found: each candidate's entry, the fastest plan that fits
    (None where none does), and what the error says when none does."""

    candidates: list[dict] = field(default_factory=list)
    best: Solved | None = None
    min_needed: float = math.inf
    refused_at_full_peak: bool = False
    # candidates whose roles no placement of some tensor satisfies, and why
    unplaceable: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Problem:
    """What every candidate of one search shares: the traced model and its analyses, the cluster,
    options and limits, and the caches filled as candidates are tried (``data_axis``: the
    data-parallel solution of one axis by its size; ``regions``: data-parallel regions by the
    ranks of the data axis, or why there is none)."""

    tg: TracedGraph
    infos: dict[str, NodeInfo]
    cinfos: dict[str, NodeInfo]  # as the cost model prices them (``half_infos``)
    classes: Classes | None
    blocks: list[Block]
    cluster: ClusterSpec
    options: SearchOptions
    precision: object
    batch: int | None
    limit: float
    profiler: NodeTimer | None
    st: _Stages
    micro: MicroBatchCheck
    data_axis: dict[int, dict[str, Strategy] | NoPlanFitsError]
    model: torch.nn.Module
    example_inputs: object
    regions: dict[int, DataRegion | str]


# HiGHS releases the GIL while it solves, and the cost tables are Python: the next candidate's
# tables are built on a worker thread while this one's ILPs solve (``_Tables``). False: all on the
# search's thread (the plan is the same either way: tests/test_search_threads.py)
PREFETCH_TABLES = True
# candidates built ahead of the one the search takes: 3 instead of 1 planned the 70B on 1024 H100s
# in 20.9 s against 19.1 s (the worker then competes more for the idle time), 8B on 64 alike
TABLES_AHEAD = 1


@dataclass
class _Prepared:
    """One candidate's pinned axes (``pinned_axes``) and cost tables (None where it is skipped),
    and what building them said, dumped and recorded, for the search to replay in order."""

    fixed: dict | None | NoPlanFitsError
    tables: CostTables | None
    said: list[str]
    writes: list[tuple[str, str]]
    candidates: list[dict]
    unplaceable: list[str]


class _Recorder(_Stages):
    """A ``_Stages`` that keeps its lines and dumps (``_Prepared``) instead of passing them on."""

    def __init__(self, dump: Path | None):
        self.dump, self.said, self.writes = dump, [], []

    def say(self, msg: str) -> None:
        self.said.append(msg)

    def write(self, name: str, text: str) -> None:
        if self.dump:
            self.writes.append((name, text))


def prepare_candidate(pb: _Problem, run: MeshRun, cluster: ClusterSpec) -> _Prepared:
    """The tables of candidate ``run`` on ``cluster`` (the whole one, or one pipeline stage's)."""
    rec = _Recorder(pb.st.dump)
    candidates: list[dict] = []
    unplaceable: list[str] = []
    tables = None
    fixed = pinned_axes(pb.tg, pb.infos, cluster, run, pb.options, pb.classes, pb.profiler, pb.data_axis)
    if isinstance(fixed, NoPlanFitsError):  # e.g. a batch of one: no data parallelism at all
        _skip(run, fixed, candidates, unplaceable, rec)
    else:
        strats = strategies_stage(
            pb.tg,
            pb.infos,
            run,
            pb.classes,
            fixed,
            candidates,
            unplaceable,
            rec,
            pb.options.sequence_attention,
        )
        if strats is not None:
            tables = cost_stage(
                pb.tg, pb.cinfos, strats, cluster, run, pb.options, pb.classes, pb.profiler, rec
            )
    return _Prepared(fixed, tables, rec.said, rec.writes, candidates, unplaceable)


class _Tables:
    """Each candidate's ``prepare_candidate``, built one candidate ahead on a worker thread while
    the search solves the one before (``PREFETCH_TABLES``): the worker runs only while the search's
    thread waits on HiGHS or on the worker (``passes/background.py``). It takes candidates in
    ``order``, the order the search asks for them; what building one said, dumped and recorded is
    replayed when the search takes it, so the search's lines, dumps and entries come as without the
    thread. A candidate asked for out of that order is built on the spot. Not threaded with a
    profiler: its timings would share the core. A context manager: on exit the worker ends."""

    def __init__(self, pb: _Problem, order: Iterator[tuple[MeshRun, ClusterSpec]], threaded: bool):
        self.pb, self.order = pb, order
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="autopar-tables") if threaded else None
        self.gate = Gate()
        self._owning = owning(self.gate) if threaded else contextlib.nullcontext()
        self.ahead: collections.deque[tuple[tuple[MeshRun, ClusterSpec], Future]] = collections.deque()

    def __enter__(self) -> _Tables:
        self._owning.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.gate.release()  # a worker waiting at a checkpoint finishes, and is not waited for long
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        self._owning.__exit__(*exc)

    def _feed(self) -> None:
        """``TABLES_AHEAD`` candidates queued on the worker beyond those the search has taken."""
        while self.pool is not None and len(self.ahead) < TABLES_AHEAD:
            try:
                key = next(self.order)
            except Exception:  # noqa: BLE001 - StopIteration, or an error the search meets itself, in turn
                self.pool.shutdown(wait=False)
                self.pool = None
                return
            self.ahead.append((key, self.pool.submit(self._work, *key)))

    def _work(self, run: MeshRun, cluster: ClusterSpec) -> _Prepared:
        with working(self.gate):  # on the worker: its checkpoints wait for the search to be idle
            return prepare_candidate(self.pb, run, cluster)

    def take(
        self, run: MeshRun, cluster: ClusterSpec, candidates: list[dict], unplaceable: list[str]
    ) -> _Prepared:
        """Candidate ``run``'s tables; what building them said and recorded passed on."""
        self._feed()
        got = None
        while self.ahead and got is None:
            key, future = self.ahead.popleft()
            if key == (run, cluster):
                with self.gate.idle():
                    got = future.result()
            else:  # the search went another way than ``order``: that one is not needed
                future.cancel()
                with self.gate.idle():  # if it started, let it end
                    concurrent.futures.wait([future])
        self._feed()  # the next candidate's tables build while this one's ILPs solve
        if got is None:
            got = prepare_candidate(self.pb, run, cluster)
        for msg in got.said:
            self.pb.st.say(msg)
        for name, text in got.writes:
            self.pb.st.write(name, text)
        candidates.extend(got.candidates)
        unplaceable.extend(got.unplaceable)
        return got


def _spmd_runs(cluster: ClusterSpec, options: SearchOptions) -> Iterator[tuple[MeshRun, tuple | None]]:
    """The SPMD candidates (``mesh_runs``; none where the options force pipeline stages), each with
    the mesh it permutes (``_mirror_key``: the same problem, solved once) or None."""
    if options.pipeline_stages is not None and options.pipeline_stages != 1:
        return
    mirrors: dict[tuple, tuple] = {}
    for run in mesh_runs(cluster, options):
        key = _mirror_key(cluster, run)
        yield run, mirrors.get(key)
        mirrors.setdefault(key, run.mesh)


def _stage_runs(
    cluster: ClusterSpec, options: SearchOptions, stages: int
) -> tuple[ClusterSpec | None, list, str]:
    """The cluster one of ``stages`` pipeline stages sees and its candidates (``stage_mesh_runs``),
    or (None, [], why there are none)."""
    sub = stage_cluster(cluster, stages)
    if sub is None:
        return None, [], f"pipeline: {stages} stages would split a node's devices unevenly: skipped"
    if options.zero_stage is not None and options.zero_stage >= ZeroStage.GRADIENTS:
        why = f"ZeRO-{int(options.zero_stage)} does not run with pipeline stages"
        return None, [], f"pipeline: {stages} stages: {why}: skipped"
    return sub, stage_mesh_runs(sub, options, stages), ""


def _table_order(pb: _Problem) -> Iterator[tuple[MeshRun, ClusterSpec]]:
    """The candidates whose tables ``_explore`` takes, in its order: the SPMD meshes, then each
    stage count's stage meshes."""
    for run, mirror in _spmd_runs(pb.cluster, pb.options):
        if mirror is None:
            yield run, pb.cluster
    for stages in stage_counts(pb.cluster.world_size, len(pb.blocks), pb.options):
        sub, runs, _ = _stage_runs(pb.cluster, pb.options, stages)
        for run in runs:
            yield run, sub


def _explore(pb: _Problem) -> _Found:
    """Every candidate: the SPMD meshes (``mesh_runs``), each down its ladder of trades, then each
    pipeline stage count (``pipeline_candidates``), pruned against the fastest plan so far."""
    tg, cinfos, blocks, cluster, options, st = pb.tg, pb.cinfos, pb.blocks, pb.cluster, pb.options, pb.st
    precision, batch, limit, micro = pb.precision, pb.batch, pb.limit, pb.micro
    found = _Found()
    candidates, unplaceable = found.candidates, found.unplaceable
    best: Solved | None = None
    best_objective = math.inf
    min_needed = math.inf
    refused_at_full_peak = False
    with _Tables(pb, _table_order(pb), threaded=PREFETCH_TABLES and pb.profiler is None) as prepared:
        for run, mirror in _spmd_runs(cluster, options):
            if mirror is not None:
                candidates.append(
                    {"mesh_shape": list(run.mesh), "status": f"same as {mirror}", "objective": None}
                )
                st.say(f"solve: mesh {run.label}: the same problem as mesh {mirror} (axes permuted)")
                continue
            got = prepared.take(run, cluster, candidates, unplaceable)
            if got.tables is None:  # e.g. a batch of one: no data parallelism at all
                continue
            tables = got.tables
            data_axes = tuple(
                a for a, r in enumerate(run.roles or ()) if r is AxisRole.DATA and run.mesh[a] > 1
            )
            fitted = 0
            bounds: dict = {}
            short: list[Trades] = []  # rungs of this candidate the ILP found no plan on
            over: list[Trades] = []  # rungs whose memory lower bound passes the limit
            slow: list[Trades] = []  # rungs whose time lower bound is no better than the best
            # what a micro-batch must still split over: the data axes; with none, any axis may split the
            # batch: the search's own micro-batches keep it divisible by every device (the solution is
            # checked either way, ``micro_batch_ok``)
            if data_axes:
                parts = math.prod(run.mesh[a] for a in data_axes)
            else:
                parts = math.prod(run.mesh) if options.micro_batches is None else 1
            zaxes, one_device = zero_axes(run.mesh, data_axes), math.prod(run.mesh) == 1
            rungs = list(ladder(options, zaxes, precision, batch, bool(blocks), one_device))
            # a region is looked for only where the user forced the data role: the automatic search
            # has other layouts, and finding one costs a trace on fewer rows and the region's check
            tried_region = (
                options.axis_roles is None
                or got.fixed is not None
                or region_parts(run.mesh, data_axes) is None
            )
            while rungs:
                trades = rungs.pop(0)
                if trades.micro_batches > 1 and (batch is None or (batch // trades.micro_batches) % parts):
                    continue
                if not micro.allows(batch, trades.micro_batches, trace=False):
                    continue
                if any(relieves_no_more(trades, t) for t in short + over):
                    continue  # a rung with at least this much room each way had no plan
                if any(costs_no_less(trades, t) for t in slow):
                    continue  # its bound is at least a pruned rung's, and the best only falls
                traded = apply_trades(tables, tg, cinfos, trades, cluster, options.optimizer, blocks)
                needed = lower_bound_bytes(traded)
                if needed > limit:  # cheap: no solve, no entry
                    min_needed = min(min_needed, needed)
                    over.append(trades)
                    continue
                if len(short) >= MAX_EMPTY_RUNGS and not any(relieves_more(trades, t) for t in short):
                    continue
                ctx = TradeContext(trades, tables, blocks, cinfos, bounds)
                outcome = solve_mesh(
                    tg, cinfos, traded, cluster, run, options, limit, best_objective, st, ctx
                )
                if outcome.entry.get("blocked") and not tried_region:
                    # an op the data role cannot split: the ops around it as one region run on each
                    # rank's own rows (passes/data_region.py), where that holds; then this candidate again
                    tried_region = True
                    region = region_stage(pb.model, pb.example_inputs, tg, pb.infos, cinfos, run, pb.classes,
                                          cluster, options, pb.profiler, st, pb.regions)  # fmt: skip
                    if isinstance(region, str):
                        outcome.entry["blocked"] += f"; as a data-parallel region: {region}"
                    else:
                        _, tables = region
                        # micro-batches would run the region on other sizes than those it was checked on
                        rungs = [
                            t
                            for t in ladder(options, zaxes, precision, batch, bool(blocks), one_device)
                            if t.micro_batches == 1
                        ]
                        bounds, short, over, slow = {}, [], [], []
                        continue
                min_needed = min(min_needed, outcome.mem_needed)
                refused_at_full_peak |= outcome.refused_at_full_peak
                candidates.append(outcome.entry)
                if outcome.solved is None and outcome.entry.get("status") == "infeasible":
                    short.append(trades)
                if outcome.entry.get("status") == "pruned" and "lp_bound" not in outcome.entry:
                    slow.append(trades)
                if outcome.fitted:  # a plan that fits, no better than the best: as a solved rung
                    fitted += 1
                    if fitted >= RUNGS_SOLVED:
                        break
                if outcome.solved is not None:
                    best_objective = min(
                        best_objective, outcome.solved.sol.objective + outcome.solved.terms.total_s
                    )
                    if best is None or outcome.solved.t_step < best.t_step - 1e-12:
                        best = outcome.solved
                    fitted += 1
                    if fitted >= RUNGS_SOLVED:
                        break  # later rungs tend to add time (passes/trades.py:ladder)
        for stages in stage_counts(cluster.world_size, len(blocks), options):
            got = pipeline_candidates(pb, stages, candidates, unplaceable, best_objective, prepared)
            min_needed = min(min_needed, got.mem_needed)
            if got.solved is not None:
                best_objective = min(best_objective, got.solved.t_step)
                if best is None or got.solved.t_step < best.t_step - 1e-12:
                    best = got.solved
    found.best, found.min_needed, found.refused_at_full_peak = best, min_needed, refused_at_full_peak
    return found


def _micro_batches_of(s: Solved) -> int:
    return s.pipe.micro_batches if s.pipe is not None else s.trades.micro_batches


# -- stages ----------------------------------------------------------------------------------------


def fuse_stage(tg: TracedGraph, cluster: ClusterSpec, options: SearchOptions, st: _Stages) -> None:
    """Outputs the plan does not return dropped (``Outputs.LOSS``), then the fused kernels
    substituted (``passes/fuse.py``); the graph dumped again where anything changed."""
    if options.outputs is Outputs.LOSS:
        keep_loss_only(tg)
    tg.kernels = fuse(tg, chosen_kernels(cluster.device.name, options.kernels))
    if tg.kernels:
        counts: dict[str, int] = {}
        for u in tg.kernels:
            counts[u.kernel.value] = counts.get(u.kernel.value, 0) + 1
        st.say("fuse: " + ", ".join(f"{k} x{n}" for k, n in counts.items()))
    if tg.kernels or options.outputs is Outputs.LOSS:
        st.write("1_fuse.py", tg.graph_module.code)


def trace_stage(model: torch.nn.Module, example_inputs, st: _Stages) -> TracedGraph:
    tg = trace(model, example_inputs, stack_traces=st.dump is not None)
    st.say(f"trace: {len(tg.graph.nodes)} nodes with {tg.tracer} ({time.perf_counter() - st.t0:.1f} s)")
    st.write("1_trace.py", tg.graph_module.code)
    return tg


def analyze_stage(tg: TracedGraph, st: _Stages) -> dict[str, NodeInfo]:
    infos = analyze(tg)
    if st.dump:
        st.write("2_analyze.tsv", infos_tsv(infos))
    return infos


def coarsen_stage(tg: TracedGraph, infos: dict[str, NodeInfo], options: SearchOptions, st: _Stages):
    classes = find_classes(tg, infos, variable_nodes(tg)) if options.coarsen else None
    if classes is not None:
        st.say(f"coarsen: {len(classes.rep)} nodes in {len(classes.members)} classes")
        if st.dump:
            st.write("2_coarsen.tsv", classes_tsv(classes))
    return classes


def mesh_runs(cluster: ClusterSpec, options: SearchOptions) -> Iterator[MeshRun]:
    """The outer search's candidates, in the order they are tried: the given mesh, or every mesh of
    up to ``MAX_MESH_AXES`` axes (as many as the roles when roles are given); without roles, each
    mesh of fewer than ``DATA_OUTER_MIN_AXES`` axes twice, free and with axis 0 data parallel (the
    ILP prices a weight's gradient all-reduce as a bucket share only on a data axis, so the free
    search overprices data parallelism; see passes/costs.py:bucketed_axes), and larger ones with
    their outer axis pinned data parallel."""
    axis_roles = options.axis_roles
    if options.mesh_shape is not None:
        meshes = [options.mesh_shape]
        if math.prod(meshes[0]) != cluster.world_size:
            raise NoPlanFitsError(
                f"mesh_shape {meshes[0]} has {math.prod(meshes[0])} devices but the cluster has {cluster.world_size}"
            )
    else:
        max_axes = len(axis_roles) if axis_roles else MAX_MESH_AXES
        meshes = [
            m
            for m in mesh_candidates(cluster.world_size, max_axes, cluster.devices_per_node)
            if not axis_roles or len(m) == len(axis_roles)
        ]
    for mesh in meshes:
        if axis_roles:
            yield MeshRun(mesh, tuple(axis_roles))
            continue
        data = (AxisRole.DATA,) + (AxisRole.AUTO,) * (len(mesh) - 1)
        if options.mesh_shape is None and len(mesh) >= DATA_OUTER_MIN_AXES:
            yield MeshRun(mesh, data, data_outer=True)
            continue
        yield MeshRun(mesh, None)
        if len(mesh) < DATA_OUTER_MIN_AXES:
            yield MeshRun(mesh, data, data_first=True)


def _mirror_key(cluster: ClusterSpec, run: MeshRun) -> tuple:
    """A mesh whose axes are another's, permuted, each on the same kind of link (and role), is the
    same problem."""
    links = [axis_link(cluster, run.mesh, a) for a in range(len(run.mesh))]
    return tuple(
        sorted(
            (n, link.bandwidth, link.latency, run.roles[a].value if run.roles else "")
            for a, (n, link) in enumerate(zip(run.mesh, links))
        )
    )


def pinned_axes(
    tg: TracedGraph,
    infos: dict[str, NodeInfo],
    cluster: ClusterSpec,
    run: MeshRun,
    options: SearchOptions,
    classes: Classes | None,
    profiler: NodeTimer | None,
    data_axis: dict,
) -> dict | None | NoPlanFitsError:
    """The axes a candidate pins (``MeshRun.data_outer``: axis 0 to the data-parallel solution of
    its size, solved once per size and kept in ``data_axis``), None when it pins none, or why there
    is no such solution."""
    if not run.data_outer:
        return None
    size = run.mesh[0]
    if size not in data_axis:
        try:
            data_axis[size] = data_parallel_axis(
                tg, infos, cluster, size, options.optimizer, classes, profiler
            )
        except NoPlanFitsError as e:
            data_axis[size] = e
    got = data_axis[size]
    return got if isinstance(got, NoPlanFitsError) else {0: got}


def strategies_stage(
    tg: TracedGraph,
    infos: dict[str, NodeInfo],
    run: MeshRun,
    classes: Classes | None,
    fixed: dict | None,
    candidates: list[dict],
    unplaceable: list[str],
    st: _Stages,
    seq_attention: SeqAttention | None = None,
) -> dict[str, NodeStrategies] | None:
    """Every node's strategies on the candidate's mesh; None (the candidate skipped, the reason
    kept for the error should no candidate fit) where its axis roles leave some tensor no
    placement (a batch of one on a data-parallel axis, a dim that does not divide)."""
    only = set(classes.members) if classes else None
    try:
        strats = build_strategies(
            tg, infos, run.mesh, run.roles, only=only, fixed=fixed, seq_attention=seq_attention
        )
    except NoPlanFitsError as e:
        _skip(run, e, candidates, unplaceable, st)
        return None
    if st.dump:
        st.write(f"3_strategies_{run.tag}.tsv", strategies_tsv(strats))
    return strats


def region_stage(
    model, example_inputs, tg: TracedGraph, infos: dict[str, NodeInfo], cinfos: dict[str, NodeInfo],
    run: MeshRun, classes: Classes | None, cluster: ClusterSpec, options: SearchOptions,
    profiler: NodeTimer | None, st: _Stages, regions: dict,
) -> tuple[dict[str, NodeStrategies], CostTables] | str:  # fmt: skip
    """The candidate's strategies and tables with its data-parallel region (``passes/data_region.py``:
    found and checked once per number of ranks on the data axis, kept in ``regions``), or why there
    is none."""
    data_axes = [a for a, r in enumerate(run.roles or ()) if r is AxisRole.DATA]
    parts = region_parts(run.mesh, data_axes)
    if parts not in regions:
        t0 = time.perf_counter()

        def rewrite(other: TracedGraph) -> None:  # as the search rewrote tg (fuse_stage)
            if options.outputs is Outputs.LOSS:
                keep_loss_only(other)
            fuse(other, {u.kernel for u in tg.kernels})

        rows = trace_rows(model, example_inputs, tg, parts, rewrite)
        if isinstance(rows, str):
            regions[parts] = rows
        else:
            one_axis = build_strategies(tg, infos, (parts,), (AxisRole.DATA,))
            regions[parts] = find_region(tg, rows, infos, one_axis, classes)
        got = regions[parts]
        said = got if isinstance(got, str) else f"{len(got.nodes)} ops run on each rank's own rows"
        st.say(f"data region on {parts} ranks: {said} ({time.perf_counter() - t0:.1f} s)")
    region = regions[parts]
    if isinstance(region, str):
        return region
    only = set(classes.members) if classes else None
    strats = build_strategies(
        tg,
        infos,
        run.mesh,
        run.roles,
        only=only,
        seq_attention=options.sequence_attention,
        regions=region.options,
    )
    if st.dump:
        st.write(f"3_strategies_{run.tag}.tsv", strategies_tsv(strats))
    return strats, cost_stage(tg, cinfos, strats, cluster, run, options, classes, profiler, st)


def _skip(run: MeshRun, e: NoPlanFitsError, candidates: list[dict], unplaceable: list[str], st: _Stages):
    """Record a candidate whose roles no placement satisfies: a skipped candidate, never fatal."""
    entry = {"mesh_shape": list(run.mesh), "status": "no placement for its axis roles", "objective": None}
    if run.roles:
        entry["axis_roles"] = [r.value for r in run.roles]
    candidates.append(entry)
    unplaceable.append(f"mesh {run.label}: {e}")
    st.say(f"solve: mesh {run.label}: skipped ({e})")


def cost_stage(
    tg: TracedGraph,
    infos: dict[str, NodeInfo],
    strats: dict[str, NodeStrategies],
    cluster: ClusterSpec,
    run: MeshRun,
    options: SearchOptions,
    classes: Classes | None,
    profiler: NodeTimer | None,
    st: _Stages,
) -> CostTables:
    tables = build_costs(
        tg, infos, strats, cluster, run.mesh, options.optimizer, run.roles, classes, profiler, options.outputs,
        options.fuses_matmuls(cluster.device.comm_overlap),
    )  # fmt: skip
    if profiler is not None:
        st.say(f"profile: mesh {run.mesh}: {profiler.take_stats().line()}")
    if st.dump:
        st.write(f"3_costs_{run.tag}.tsv", costs_tsv(tables))
    return tables


@dataclass(frozen=True)
class TradeContext:
    """What ``solve_mesh`` needs to price a rung of the trades ladder on a solution: the rung, the
    tables without trades, the blocks and the infos the tables were built from."""

    trades: Trades
    base: CostTables
    blocks: list[Block]
    infos: dict[str, NodeInfo]
    # the candidate's time lower bounds by the trades that change table times (micro-batches
    # change only bytes there): rungs that differ in micro-batches share one fold and bound
    bounds: dict = field(default_factory=dict)

    @property
    def bound_key(self) -> tuple:
        t = self.trades
        return (t.zero_stage, t.recompute, t.offload, t.precision)


@dataclass
class MeshOutcome:
    """What solving one candidate gave: its entry in the plan's candidate list, the memory it needs
    at least, and the solution when one fits."""

    entry: dict
    mem_needed: float
    solved: Solved | None = None
    refused_at_full_peak: bool = False
    # pruned by the ILP's LP relaxation: it has a plan, no better than the best (a rung that fits,
    # as far as the trades ladder is concerned: the ILP would have solved it, and lost)
    fitted: bool = False


def solve_mesh(
    tg: TracedGraph,
    infos: dict[str, NodeInfo],
    tables: CostTables,
    cluster: ClusterSpec,
    run: MeshRun,
    options: SearchOptions,
    limit: float,
    best_objective: float,
    st: _Stages,
    ctx: TradeContext | None = None,
    check_micro_batches: bool = True,
) -> MeshOutcome:
    """Solve one candidate: skip it when its memory lower bound passes the limit or its time lower
    bound is no better than the best objective so far; else the ILP, then the chosen solution's
    gradient buckets and full peak (solving again, once, with as much less room as that peak passes
    the limit: the buckets' flattening and the optimizer step's temporaries are not in the ILP's rows)."""
    mesh, label = run.mesh, run.label
    trades = ctx.trades if ctx else Trades()
    if not trades.is_default:
        label = f"{label} [{trades.describe()}]"
    mem_needed = lower_bound_bytes(tables)
    exact = None
    if ctx is not None and ctx.bound_key in ctx.bounds:
        bound = ctx.bounds[ctx.bound_key]
    else:
        exact = fold_followers(tables, exact=True)  # keeps the optimum: the bound is valid on it
        bound = lower_bound(tables, exact)
        if ctx is not None:
            ctx.bounds[ctx.bound_key] = bound
    entry = {"mesh_shape": list(mesh), "lower_bound": bound, "trades": trades.to_dict()}
    if run.roles:
        entry["axis_roles"] = [r.value for r in run.roles]
    if mem_needed > limit:
        st.say(f"solve: mesh {label}: needs >= {mem_needed / 2**30:.2f} GiB per device: skipped")
        return MeshOutcome({**entry, "status": "infeasible", "objective": None}, mem_needed)
    # pruning compares the tables' totals (the bound is one of those); the overlap adjustment
    # below re-ranks the meshes that get solved
    if bound >= best_objective:
        st.say(f"solve: mesh {label}: lower bound {bound * 1e3:.3f} ms >= best: pruned")
        return MeshOutcome({**entry, "status": "pruned", "objective": None}, mem_needed)
    # the ILP's tables: only meshes that get solved pay for this fold
    small = edge_pairs(tables) <= EXACT_FOLD_MAX_PAIRS
    folded = exact if small and exact is not None else fold_followers(tables, exact=small)
    # the best so far as a cutoff: where the ILP's LP relaxation already passes it, the ILP itself
    # is not solved (only whether it has a plan: a candidate with none is reported as before)
    sol = solve(tables, limit, options.time_limit_s, folded=folded, cutoff=best_objective)
    if isinstance(sol, Pruned):
        st.say(f"solve: mesh {label}: LP relaxation {sol.bound * 1e3:.3f} ms >= best: pruned")
        return MeshOutcome(
            {**entry, "lp_bound": sol.bound, "status": "pruned", "objective": None}, mem_needed, fitted=True
        )
    if sol is None:
        why = blocked(tables, {n.name: n for n in tg.graph.nodes})
        if why is not None:  # no choice at all, whatever the memory: name the op
            st.say(f"solve: mesh {label}: no plan under its axis roles: {why}")
            return MeshOutcome(
                {**entry, "status": "infeasible", "objective": None, "blocked": why}, mem_needed
            )
        st.say(f"solve: mesh {label}: no plan fits {limit / 2**30:.2f} GiB per device")
        return MeshOutcome({**entry, "status": "infeasible", "objective": None}, mem_needed)
    # the full price of the choice (solve evaluates it), with the gradient all-reduces as they run:
    # once per parameter, partly behind backward compute (passes/grad_sync.py)
    choice = expanded_choice(tg, tables, sol)
    gs = grad_sync_cost(tg, infos, tables, sol, choice, cluster, mesh, options.outputs)
    terms = _terms(ctx, tables, sol, cluster, options)
    over = plan_peak(tables, sol, gs) + terms.transient - limit
    if over > 0:
        sol = solve(tables, limit - over, options.time_limit_s, folded=folded)
        if sol is not None:
            choice = expanded_choice(tg, tables, sol)
            gs = grad_sync_cost(tg, infos, tables, sol, choice, cluster, mesh, options.outputs)
            terms = _terms(ctx, tables, sol, cluster, options)
        if sol is None or plan_peak(tables, sol, gs) + terms.transient > limit:
            st.say(
                f"solve: mesh {label}: no plan fits {limit / 2**30:.2f} GiB per device "
                "with its gradient buckets' flattening and its optimizer step's temporaries"
            )
            return MeshOutcome({**entry, "status": "infeasible", "objective": None}, mem_needed, None, True)
    if check_micro_batches and not micro_batch_ok(tg, infos, sol.choice, tables, trades.micro_batches):
        st.say(f"solve: mesh {label}: the batch does not split into its micro-batches as the plan splits it")
        return MeshOutcome({**entry, "status": "infeasible", "objective": None}, mem_needed)
    host_limit = cluster.host_memory_bytes / max(cluster.devices_per_node, 1)
    if terms.host_bytes > host_limit:
        st.say(
            f"solve: mesh {label}: offloaded state needs {_size(terms.host_bytes)} of host memory per device"
        )
        return MeshOutcome({**entry, "status": "infeasible", "objective": None}, mem_needed)
    t_step = sol.objective + gs.adjustment_s + terms.total_s
    st.say(
        f"solve: mesh {label}: {sol.status}, predicted step {t_step * 1e3:.3f} ms "
        f"({sol.num_variables} variables, {sol.solve_time_s:.2f} s)"
    )
    st.write(
        f"4_solve_{run.tag}.json",
        json.dumps({"status": sol.status, "objective": t_step, "choice": sol.choice}, indent=0),
    )
    return MeshOutcome(
        {**entry, "status": sol.status, "objective": t_step},
        mem_needed,
        Solved(t_step, run, sol, tables, bound, gs, choice, trades, terms),
    )


def _terms(
    ctx: TradeContext | None, tables: CostTables, sol: Solution, cluster: ClusterSpec, options
) -> TradeTerms:
    if ctx is None:
        return TradeTerms()
    return trade_terms(
        ctx.base, tables, sol.choice, ctx.infos, ctx.trades, cluster, options.optimizer, ctx.blocks
    )


def stage_mesh_runs(sub: ClusterSpec, options: SearchOptions, stages: int) -> list[MeshRun]:
    """The stage meshes tried for ``stages`` pipeline stages: the given one, else per tensor
    degree ``t`` (a divisor of the stage's devices, at most a node's) the mesh ``(M / t, t)``,
    axis 0 data parallel and axis 1 tensor parallel (``(M,)`` tensor parallel where ``t = M``,
    data parallel where ``t = 1``), the largest ``t`` first: the layouts Megatron-LM pipelines
    (tensor parallel inside a node, data parallel outside, the pipeline outermost), the ILP
    placing every op on them. A tensor axis keeps the inputs whole, so the micro-batches split only
    over the data axis."""
    m = sub.world_size
    if options.mesh_shape is not None:
        if math.prod(options.mesh_shape) != m:
            raise NoPlanFitsError(
                f"mesh_shape {options.mesh_shape} has {math.prod(options.mesh_shape)} devices, but "
                f"{stages} pipeline stages of the cluster's {m * stages} devices have {m} each; give a mesh of {m}"
            )
        return [MeshRun(options.mesh_shape, options.axis_roles, stages=stages)]
    runs = []
    for t in sorted((t for t in range(1, m + 1) if m % t == 0 and t <= sub.devices_per_node), reverse=True):
        if t == m:
            run = MeshRun((m,), (AxisRole.TENSOR,), stages=stages)
        elif t == 1:
            run = MeshRun((m,), (AxisRole.DATA,), stages=stages)
        else:
            run = MeshRun((m // t, t), (AxisRole.DATA, AxisRole.TENSOR), data_outer=True, stages=stages)
        if options.axis_roles is None or tuple(options.axis_roles) == run.roles:
            runs.append(run)
    return runs


def pipeline_candidates(
    pb: _Problem,
    stages: int,
    candidates: list[dict],
    unplaceable: list[str],
    best_objective: float,
    prepared: _Tables,
) -> MeshOutcome:
    """The best plan with ``stages`` pipeline stages (``passes/pipeline.py``): per stage mesh
    (``stage_mesh_runs``), the ladder of trades at the pipeline's micro-batches (ZeRO 0-1: FSDP2's
    groups do not run under torch's schedules here), each rung one ILP on the rows of the stage
    that holds the most, then the cut, schedule and chunks per rank priced on the solution. The
    entries join ``candidates``; the outcome carries the fastest that fits."""
    tg, cinfos, blocks, options, st = pb.tg, pb.cinfos, pb.blocks, pb.options, pb.st
    cluster, precision, batch, limit, micro = pb.cluster, pb.precision, pb.batch, pb.limit, pb.micro
    found = MeshOutcome({}, math.inf)
    sub, runs, why = _stage_runs(cluster, options, stages)
    if sub is None:
        st.say(why)
        return found
    regions = Regions.of(tg, blocks)
    schedule = options.schedule or Schedule.ONE_F_ONE_B
    for run in runs:
        tables = prepared.take(run, sub, candidates, unplaceable).tables
        if tables is None:
            continue
        data_axes = tuple(a for a, r in enumerate(run.roles or ()) if r is AxisRole.DATA and run.mesh[a] > 1)
        # what a micro-batch must split over: the data axes (a solution that splits the batch on
        # another axis too gets fewer micro-batches, below)
        parts = math.prod(run.mesh[a] for a in data_axes) if data_axes else 1
        ks = [
            k
            for k in micro_batch_counts(batch, parts, stages, options)
            if micro.allows(batch, k, trace=False)  # one-row counts: traced where their plan wins
        ]
        if not ks:
            st.say(f"pipeline: mesh {run.label}: no micro-batch count keeps the model's step: skipped")
            continue
        k = ks[0]
        zero = options.zero_stage if options.zero_stage is not None else None
        popts = dataclasses.replace(options, micro_batches=k, offload=Offload.NONE, zero_stage=zero)
        rungs = [t for t in ladder(popts, data_axes, precision, batch, bool(blocks)) if t.zero_stage <= 1]
        bounds: dict = {}
        over: list[Trades] = []
        for trades in rungs:
            if batch is not None and (batch % k or (batch // k) % parts):
                continue
            if any(relieves_no_more(trades, t) for t in over):
                continue
            traded = apply_trades(tables, tg, cinfos, trades, sub, options.optimizer, blocks)
            ptables = stage_tables(traded, cinfos, regions, stages, in_flight(schedule, stages, k))
            needed = lower_bound_bytes(ptables)
            if needed > limit:
                found.mem_needed = min(found.mem_needed, needed)
                over.append(trades)
                continue
            ctx = TradeContext(trades, tables, blocks, cinfos, bounds)
            # pruned against the best step: a pipeline of S stages runs at best 1/S of the model's time
            outcome = solve_mesh(
                tg, cinfos, ptables, sub, run, options, limit, best_objective * stages, st, ctx,
                check_micro_batches=False,
            )  # fmt: skip
            found.mem_needed = min(found.mem_needed, outcome.mem_needed)
            if outcome.solved is None:
                candidates.append({**outcome.entry, "pipeline_stages": stages})
                if outcome.entry.get("status") == "pruned":
                    break  # every later rung adds time
                continue
            solved = outcome.solved
            if not micro_batch_ok(tg, cinfos, solved.sol.choice, ptables, k):
                # the solution splits the batch over more devices than the micro-batches allow: the
                # most micro-batches it does allow (more memory than the rows priced: checked below)
                split = solution_batch_parts(tg, cinfos, solved.sol.choice, ptables)
                fewer = [
                    k
                    for k in micro_batch_counts(batch, split, stages, options)
                    if micro.allows(batch, k, trace=False)
                ]
                if not fewer:
                    continue
                trades = dataclasses.replace(trades, micro_batches=fewer[0])
                traded = apply_trades(tables, tg, cinfos, trades, sub, options.optimizer, blocks)
            # priced on the step's own tables, not the fullest stage's rows (as autopar.reprice does);
            # the gradient sync reads only their seconds, which the rows (``stage_tables``) keep:
            # solve_mesh's holds unless the micro-batches changed above
            if trades is not solved.trades:
                gs = grad_sync_cost(
                    tg, cinfos, traded, solved.sol, solved.choice, sub, run.mesh, options.outputs
                )
            else:
                gs = solved.gs
            terms = trade_terms(
                tables, traded, solved.sol.choice, cinfos, trades, sub, options.optimizer, blocks
            )  # fmt: skip
            solved = dataclasses.replace(solved, gs=gs, terms=terms, trades=trades)
            why: list[str] = []
            price = price_pipeline(
                PipelineProblem(
                    tg, cinfos, tables, traded, solved.sol.choice, solved.choice, blocks, trades, stages, cluster,
                    options, limit, gs.adjustment_s + terms.total_s, terms.transient,
                ),
                why=why,
            )  # fmt: skip
            entry = {**outcome.entry, "pipeline_stages": stages}
            if price is None:
                st.say(f"solve: mesh {run.label} [{trades.describe()}]: no pipeline: {'; '.join(why)}")
                candidates.append({**entry, "status": "infeasible", "objective": None})
                over.append(trades)
                continue
            entry.update(objective=price.step_s, pipeline=price.pipeline.to_dict())
            candidates.append(entry)
            st.say(
                f"pipeline: mesh {run.label} [{trades.describe()}]: {price.pipeline.describe()}, {k} micro-batches, "
                f"predicted step {price.step_s * 1e3:.3f} ms"
            )
            got = dataclasses.replace(solved, t_step=price.step_s, pipe=price, cluster=sub)
            if found.solved is None or got.t_step < found.solved.t_step:
                found.solved = got
                best_objective = min(best_objective, got.t_step)
            break  # the first rung that fits (passes/trades.py:ladder)
    return found


def solution_batch_parts(
    tg: TracedGraph, infos: dict[str, NodeInfo], choice: dict, tables: CostTables
) -> int:
    """The devices a solution splits the batch (the inputs' dim 0) over."""
    parts = 1
    for p in tg.placeholders:
        if p.role is Role.INPUT and p.name in choice:
            s = tables.strategies[p.name][choice[p.name]]
            parts = max(
                parts, math.prod(n for q, n in zip(s.out, tables.mesh_shape) if is_shard(q) and q.dim == 0)
            )
    return parts


def with_pipeline(plan: Plan, price: PipelinePrice, cluster: ClusterSpec) -> Plan:
    """The plan with its pipeline: the decision, per chunk its price, and the predicted step and
    memory of the fullest pipeline rank; ``cluster`` the whole one (the tables priced one stage's)."""
    p = plan.predicted
    param, grad, opt = price.worst_state
    predicted = dataclasses.replace(
        p,
        step_time_s=price.step_s,
        compute_s=price.compute_s,
        comm_s=max(price.step_s - price.compute_s - price.bubble_s, 0.0),
        peak_memory_bytes=int(max(price.peak)),
        param_bytes=int(param),
        grad_bytes=int(grad),
        optimizer_bytes=int(opt),
        activation_bytes=int(price.worst_activations),
    )
    trades = dataclasses.replace(plan.trades, micro_batches=price.micro_batches)
    s = price.pipeline.stages  # the trades were priced on the whole model: each stage runs 1/S of it
    costs = {k: {**v, "seconds": v.get("seconds", 0.0) / s} for k, v in plan.trade_costs.items()}
    # the bound is the whole model's on one stage's mesh: a pipeline of S stages is at best 1/S of it
    solver = dataclasses.replace(plan.solver, lower_bound_s=plan.solver.lower_bound_s / s)
    return dataclasses.replace(
        plan, cluster=cluster.to_dict(), predicted=predicted, trades=trades, pipeline=price.pipeline,
        stage_costs=price.stage_costs, trade_costs=costs, solver=solver,
    )  # fmt: skip


def relieves_no_more(a: Trades, b: Trades) -> bool:
    """Rung ``a`` frees no more memory than ``b`` in any trade (so where ``b`` has no plan, nor
    has ``a``: each trade's bytes only fall as it climbs, ZeRO-3's gathered blocks aside)."""
    return (
        a.zero_stage <= b.zero_stage
        and _RECOMPUTE_ORDER[a.recompute.value] <= _RECOMPUTE_ORDER[b.recompute.value]
        and a.micro_batches <= b.micro_batches
        and (a.offload.value == "none" or b.offload.value != "none")
    )


def costs_no_less(a: Trades, b: Trades) -> bool:
    """Rung ``a``'s time lower bound is at least ``b``'s: the same ZeRO stage, offload and
    precision, and at least as much recomputation (forwards run again) and as many micro-batches
    (each pays its collectives' latency, and ZeRO-3 its gathers); so where ``b`` was pruned by its
    bound, so is ``a`` (``tests/test_search_prune.py`` checks the bounds are so ordered)."""
    return (
        a.zero_stage == b.zero_stage
        and a.offload is b.offload
        and a.precision is b.precision
        and a.data_axes == b.data_axes
        and _RECOMPUTE_ORDER[a.recompute.value] >= _RECOMPUTE_ORDER[b.recompute.value]
        and a.micro_batches >= b.micro_batches
    )


def relieves_more(a: Trades, b: Trades) -> bool:
    """Rung ``a`` frees at least as much as ``b`` in every trade and more in one."""
    return relieves_no_more(b, a) and a != b


_RECOMPUTE_ORDER = {"none": 0, "selective": 1, "full": 2}


def _size(nbytes: float) -> str:
    """Bytes in a unit that shows the figure: 1.50 GiB, 12.3 MiB, 800 KiB, 12 B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def select_stage(
    best: Solved | None,
    candidates: list[dict],
    cluster: ClusterSpec,
    limit: float,
    min_needed: float,
    refused_at_full_peak: bool,
    unplaceable: list[str],
    st: _Stages,
    options: SearchOptions | None = None,
) -> Solved:
    """The candidate with the smallest predicted step (the search loop keeps it), or the error
    that says why none fits: the memory the best candidate needs, or, where no candidate could
    place the model under its axis roles, why not."""
    st.write("5_select.json", json.dumps(candidates, indent=1, default=str))
    if best is None and min_needed == math.inf and unplaceable:
        raise NoPlanFitsError("no plan: no candidate mesh can place the model; " + "; ".join(unplaceable))
    infeasible = [c for c in candidates if c.get("status") == "infeasible"]
    if best is None and infeasible and all(c.get("blocked") for c in infeasible):
        reasons = list(dict.fromkeys(c["blocked"] for c in infeasible))
        raise NoPlanFitsError(
            "no plan: the axis roles cannot be honoured on any candidate: "
            + "; ".join(reasons[:3])
            + "; use AxisRole.AUTO on that axis (or another role), or change the model's op"
        )
    if best is None:
        raise NoPlanFitsError(no_fit_message(cluster, limit, min_needed, refused_at_full_peak, options))
    return best


def no_fit_message(
    cluster: ClusterSpec,
    limit: float,
    min_needed: float,
    refused_at_full_peak: bool,
    options: SearchOptions | None,
) -> str:
    """Why no plan fits, with the figure that shows it and what would bring a plan under the limit:
    the least memory any candidate's bound proves it needs when that passes the limit, else that the
    plans the solver could build all pass it (a bound under the limit is no figure to quote); then
    the trades the options forbid, more devices, a smaller batch."""
    options = options or SearchOptions()
    where = (
        f"({cluster.device.name}, {cluster.world_size} devices, {cluster.memory_reserve:.0%} of "
        "memory held in reserve)"
    )
    if min_needed > limit and math.isfinite(min_needed):
        head = (
            f"no plan fits: every candidate needs at least {_size(min_needed)} per device, the limit "
            f"is {_size(limit)} {where}"
        )
    else:
        head = f"no plan fits in {_size(limit)} per device {where}: every plan the solver found passes it"
    if refused_at_full_peak:
        head += "; a plan that fit did not with its gradient buckets flattened and its optimizer step"
    tries = []
    if options.zero_stage is not None and options.zero_stage < 3:
        tries.append("zero_stage=3 (or None: auto)")
    if options.axis_roles is None or not any(r.value == "data" for r in options.axis_roles):
        tries.append("axis_roles with AxisRole.DATA (ZeRO shards over data-parallel axes)")
    if options.recompute is not None and options.recompute.value != "full":
        tries.append("recompute=Recompute.FULL (or None)")
    if options.micro_batches is not None:
        tries.append("more micro_batches (or None)")
    if options.offload is not None and options.offload.value == "none":
        tries.append("offload=Offload.OPTIMIZER (or None)")
    if options.precision is not None and options.precision.value == "param":
        tries.append("precision=Precision.BF16")
    if options.pipeline_stages == 1 or options.mesh_shape is not None or options.axis_roles is not None:
        tries.append("pipeline stages (pipeline_stages=None: auto, or a count)")
    tries += ["more devices", "a smaller batch or sequence", "a larger memory_limit_bytes"]
    return f"{head}; try " + ", ".join(tries)


def price_stage(
    tg: TracedGraph,
    infos: dict[str, NodeInfo],
    best: Solved,
    cluster: ClusterSpec,
    options: SearchOptions,
    candidates: list[dict],
    st: _Stages,
) -> Plan:
    plan = price_plan(
        tg, infos, best.tables, best.sol, best.choice, best.cluster or cluster, best.run.mesh, options.optimizer,
        candidates, best.bound, best.gs, options.outputs,
    )  # fmt: skip
    plan = dataclasses.replace(with_trades(plan, tg, infos, best, options), kernels=tg.kernels)
    if best.pipe is not None:
        plan = with_pipeline(plan, best.pipe, cluster)
    if st.dump:
        plan.save(st.dump / "6_plan.json")
    st.say(f"plan: mesh {best.run.mesh}, {time.perf_counter() - st.t0:.1f} s in all")
    return plan


def with_trades(plan: Plan, tg: TracedGraph, infos: dict[str, NodeInfo], best: Solved, options) -> Plan:
    """The plan with its trades, what each costs and saves, and its predicted step, peak and state
    bytes as the trades make them (``passes/trades.py``)."""
    trades, terms = best.trades, best.terms or TradeTerms()
    p = plan.predicted
    mesh = best.run.mesh
    param = grad = opt = 0.0
    for n in tg.placeholders:
        info = infos[n.name]
        if info.role is not Role.PARAM or n.name not in best.choice or not info.dtype:
            continue
        sb = param_state(info, best.choice[n.name].out, mesh, trades, options.optimizer)
        param, grad, opt = param + sb.param, grad + sb.grad, opt + sb.optimizer
    # the tables' peak (the trades' transients aside) less the state and the buffers and inputs
    act = p.peak_memory_bytes - (param + grad + opt) - buffers_inputs_bytes(infos, best.choice, mesh)
    predicted = dataclasses.replace(
        p,
        step_time_s=p.step_time_s + terms.total_s,
        comm_s=p.comm_s
        + terms.seconds.get("zero", 0.0)
        + terms.seconds.get("offload", 0.0)
        + terms.seconds.get("micro_batches", 0.0),
        compute_s=p.compute_s,
        peak_memory_bytes=int(p.peak_memory_bytes + terms.transient),
        param_bytes=int(param),
        grad_bytes=int(grad),
        optimizer_bytes=int(opt),
        activation_bytes=int(max(act, 0.0)),
    )
    return dataclasses.replace(plan, predicted=predicted, trades=trades, trade_costs=terms.costs())


def data_parallel_axis(
    tg: TracedGraph,
    infos: dict[str, NodeInfo],
    cluster: ClusterSpec,
    size: int,
    optimizer: Optimizer,
    classes: Classes | None,
    profiler: NodeTimer | None = None,
) -> dict[str, Strategy]:
    """Every node's placement on one data-parallel axis of ``size`` devices: the plan the solver
    picks on the mesh ``(size,)`` with parameters replicated and inputs split on dim 0."""
    mesh = (size,)
    roles = (AxisRole.DATA,)
    strats = build_strategies(tg, infos, mesh, roles, only=set(classes.members) if classes else None)
    tables = build_costs(tg, infos, strats, cluster, mesh, optimizer, roles, classes, profiler)
    sol = solve(tables, math.inf)
    if sol is None:  # no memory limit: cannot happen unless the roles forbid every strategy somewhere
        raise NoPlanFitsError(
            f"no data-parallel placement over {size} devices; pass mesh_shape=... explicitly"
        )
    return {v: tables.strategies[v][i] for v, i in sol.choice.items()}


# -- dumps -----------------------------------------------------------------------------------------


def infos_tsv(infos: dict[str, NodeInfo]) -> str:
    rows = ["name\trole\ttarget\tshape\tdtype\tflops\tbytes\trequires_grad"]
    for i in infos.values():
        rows.append(
            f"{i.name}\t{i.role.value}\t{i.target}\t{i.shape}\t{i.dtype}\t{i.flops:.0f}\t{i.bytes}\t{i.requires_grad}"
        )
    return "\n".join(rows) + "\n"


def classes_tsv(classes: Classes) -> str:
    rows = ["representative\tcount\tmembers"]
    for rep, members in classes.members.items():
        rows.append(f"{rep}\t{len(members)}\t{','.join(members)}")
    return "\n".join(rows) + "\n"


def strategies_tsv(strats: dict[str, NodeStrategies]) -> str:
    rows = ["node\tindex\toutput\tinputs"]
    for name, ns in strats.items():
        for k, s in enumerate(ns.strategies):
            rows.append(f"{name}\t{k}\t{spec_to_str(s.out)}\t{' '.join(spec_to_str(x) for x in s.ins)}")
    return "\n".join(rows) + "\n"


def costs_tsv(tables: CostTables) -> str:
    """Per variable node and strategy: seconds and bytes; per edge: its (source, destination)
    matrix of seconds, one row per source strategy."""
    rows = ["kind\tname\tstrategy\toutput\tseconds\tbytes"]
    for v, ss in tables.strategies.items():
        for k, s in enumerate(ss):
            rows.append(
                f"node\t{v}\t{k}\t{spec_to_str(s.out)}\t{tables.node_cost[v][k]!r}\t{tables.node_mem[v][k]!r}"
            )
    for e in tables.edges:
        for a, row in enumerate(e.cost):
            rows.append(
                f"edge\t{e.src}->{e.dst}\t{a}\t\t{' '.join(repr(c) for c in row)}\t{' '.join(repr(m) for m in e.mem[a])}"
            )
    return "\n".join(rows) + "\n"
