"""How a rung of the trades ladder is priced, for each kind of candidate (``passes/ladder.py``'s
``Pricer``), and each kind's climb down its ladder.

* An SPMD candidate (``SpmdRungs``, ``spmd_climb``): the ILP on the candidate's tables transformed
  by the rung's trades (``solve_mesh``). Where an op blocks the data role the user forced, once
  per candidate, its ops around it as one data-parallel region (``passes/data_region.py``) and the
  candidate again from the first rung, without micro-batches (they would run the region on other
  sizes than those it was checked on).
* A pipeline candidate (``PipelineRungs``, ``pipeline_climb``): the ladder at the pipeline's
  micro-batches, ZeRO 0-1 only (FSDP2's groups do not run under torch's schedules here), each
  rung one ILP on the rows of the stage that holds the most (``passes/pipeline.py:stage_tables``);
  on its solution the cut, schedule and chunks per rank priced (``price_pipeline``). A pruned rung
  ends the climb: every later rung adds time.
"""

from __future__ import annotations

import dataclasses
import math

from autopar.cluster import ClusterSpec
from autopar.cost_model.comm import CommModel
from autopar.passes.analyze import NodeInfo
from autopar.passes.candidate_tables import Prepared, region_stage
from autopar.passes.candidates import MeshRun
from autopar.passes.costs import CostTables
from autopar.passes.data_region import region_parts
from autopar.passes.grad_sync import reduced_after_schedule
from autopar.passes.ladder import Climb, Lesson, Rung, RungTables, climb
from autopar.passes.mesh_solve import MeshProblem, TradeContext, solve_mesh
from autopar.passes.outcome import Verdict
from autopar.passes.pipeline import (
    PipelineProblem,
    Regions,
    in_flight,
    micro_batch_counts,
    price_pipeline,
    stage_tables,
)
from autopar.passes.precision import compute_param_dtype, grad_dtype
from autopar.passes.price import grad_sync_cost
from autopar.passes.search_problem import Problem
from autopar.passes.trace import Role, TracedGraph
from autopar.passes.trade_terms import trade_terms, zero_one_axes
from autopar.passes.trades import (
    apply_trades,
    ladder,
    micro_batch_ok,
    partial_sides,
    traded_lower_bound,
    zero_axes,
)
from autopar.placement import is_shard
from autopar.trades import Offload, Pipeline, Schedule, Trades


class SpmdRungs:
    """The rungs of one SPMD candidate ``run`` on its tables (module docstring). Holds the
    candidate's tables (its region's, once found) and its time lower bounds by trades."""

    def __init__(
        self, pb: Problem, run: MeshRun, got: Prepared, rungs: list[Trades], hints: tuple[dict, ...] = ()
    ):
        self.pb, self.run, self.base, self.rungs, self.hints = pb, run, got.tables, rungs, hints
        data_axes = run.data_axes
        # what a micro-batch must still split over: the data axes; with none, any axis may split the
        # batch: the search's own micro-batches keep it divisible by every device (the solution is
        # checked either way, ``micro_batch_ok``)
        if data_axes:
            self.parts = math.prod(run.mesh[a] for a in data_axes)
        else:
            self.parts = math.prod(run.mesh) if pb.options.micro_batches is None else 1
        self.bounds: dict = {}
        # a region is looked for only where the user forced the data role: the automatic search
        # has other layouts, and finding one costs a trace on fewer rows and the region's check
        self.tried_region = (
            pb.options.axis_roles is None
            or got.fixed is not None
            or region_parts(run.mesh, data_axes) is None
        )

    def admits(self, trades: Trades) -> bool:
        batch = self.pb.batch
        if trades.micro_batches > 1 and (batch is None or (batch // trades.micro_batches) % self.parts):
            return False
        return self.pb.micro.allows(batch, trades.micro_batches, trace=False)

    def tables(self, trades: Trades) -> RungTables:
        pb = self.pb
        traded = apply_trades(
            self.base, pb.tg, pb.cinfos, trades, pb.cluster, pb.options.optimizer, pb.blocks
        )
        return RungTables(traded, traded)

    def bound(self, trades: Trades) -> float:
        """The memory lower bound of ``tables(trades)``, without building its traded edges."""
        pb = self.pb
        return traded_lower_bound(
            self.base, pb.cinfos, trades, pb.cluster, pb.options.optimizer, pb.blocks
        )  # fmt: skip

    def price(self, trades: Trades, tables: RungTables, best_objective: float) -> Rung:
        pb = self.pb
        ctx = TradeContext(trades, self.base, pb.blocks, pb.cinfos, self.bounds)
        problem = MeshProblem(
            pb.tg, pb.cinfos, tables.ilp, pb.cluster, self.run, pb.options, pb.limit, ctx, hints=self.hints,
            mem_needed=tables.needed,
        )  # fmt: skip
        outcome = solve_mesh(problem, best_objective, pb.st)
        entry = outcome.entry
        if entry.verdict is Verdict.BLOCKED and not self.tried_region:
            # an op the data role cannot split: the ops around it as one region run on each rank's
            # own rows (passes/data_region.py), where that holds; then this candidate again
            self.tried_region = True
            region = region_stage(pb, self.run)
            if isinstance(region, str):
                entry = dataclasses.replace(
                    entry, blocked=f"{entry.blocked}; as a data-parallel region: {region}"
                )
            else:
                _, self.base = region
                self.bounds = {}
                return Rung(Lesson.NOTHING, restart=tuple(t for t in self.rungs if t.micro_batches == 1))
        solved = outcome.solved
        if solved is not None:
            lesson, objective = Lesson.FITS, solved.sol.objective + solved.terms.total_s
        else:
            objective = math.inf
            # blocked: an op has no strategy under the axis roles, whatever the memory; no trade
            # adds one (micro-batches only shrink the rows a strategy splits)
            lesson = {
                Verdict.BOUND_PRUNED: Lesson.SLOW,
                Verdict.LP_PRUNED: Lesson.BEATEN,
                Verdict.BLOCKED: Lesson.LAST,
            }.get(entry.verdict, Lesson.NO_PLAN if entry.verdict.infeasible else Lesson.NOTHING)
        return Rung(
            lesson, entry, outcome.mem_needed, solved, objective, outcome.refused_at_full_peak,
            refused_peak=outcome.refused_peak, peak=solved.peak if solved is not None else 0.0,
            host_needed=outcome.host_needed,
        )  # fmt: skip


def spmd_climb(
    pb: Problem, run: MeshRun, got: Prepared, best_objective: float, hints: tuple[dict, ...] = ()
) -> Climb:
    """SPMD candidate ``run`` (its tables ``got``) down its ladder of trades. ``hints``: plans of
    other candidates on its mesh (``MeshProblem.hints``)."""
    zaxes, one_device = zero_axes(run.mesh, run.data_axes), math.prod(run.mesh) == 1
    rungs = list(ladder(pb.options, zaxes, pb.precision, pb.batch, bool(pb.blocks), one_device))
    return climb(
        rungs, SpmdRungs(pb, run, got, rungs, hints), pb.limit, best_objective, partial_blocks(pb, 1)
    )


class PipelineRungs:
    """The rungs of pipeline candidate ``run`` (one stage's mesh, on ``sub``: one stage's devices)
    with ``k`` micro-batches of which each splits over ``parts`` devices (module docstring)."""

    def __init__(self, pb: Problem, run: MeshRun, sub: ClusterSpec, base: CostTables, k: int, parts: int):
        self.pb, self.run, self.sub, self.base, self.k, self.parts = pb, run, sub, base, k, parts
        self.regions = Regions.of(pb.tg, pb.blocks)
        self.schedule = pb.options.schedule or Schedule.ONE_F_ONE_B
        self.bounds: dict = {}

    def admits(self, trades: Trades) -> bool:
        batch, k = self.pb.batch, self.k
        return batch is None or not (batch % k or (batch // k) % self.parts)

    def _traded(self, trades: Trades) -> CostTables:
        pb = self.pb
        # a partly recomputed step's rows as the stages' even cut chooses its blocks (each pipeline
        # is priced on its own cut: ``price_pipeline``, ``PipelineProblem.sides``)
        stages = self.run.stages
        cuts = Pipeline.even_cuts(len(pb.blocks), stages) if trades.recompute_blocks is not None else ()
        return apply_trades(
            self.base, pb.tg, pb.cinfos, trades, self.sub, pb.options.optimizer, pb.blocks, cuts, stages
        )  # fmt: skip

    def tables(self, trades: Trades) -> RungTables:
        traded, stages = self._traded(trades), self.run.stages
        rows = stage_tables(
            traded, self.pb.cinfos, self.regions, stages, in_flight(self.schedule, stages, self.k)
        )  # fmt: skip
        return RungTables(traded, rows)

    def price(self, trades: Trades, tables: RungTables, best_objective: float) -> Rung:
        pb, run, sub, stages = self.pb, self.run, self.sub, self.run.stages
        tg, cinfos, options = pb.tg, pb.cinfos, pb.options
        ctx = TradeContext(trades, self.base, pb.blocks, cinfos, self.bounds)
        problem = MeshProblem(
            tg, cinfos, tables.ilp, sub, run, options, pb.limit, ctx, check_micro_batches=False,
            mem_needed=tables.needed,
        )  # fmt: skip
        # pruned against the best step: a pipeline of S stages runs at best 1/S of the model's time
        outcome = solve_mesh(problem, best_objective * stages, pb.st)
        needed, entry = outcome.mem_needed, dataclasses.replace(outcome.entry, pipeline_stages=stages)
        if outcome.solved is None:
            return Rung(Lesson.LAST if entry.verdict.pruned else Lesson.NOTHING, entry, needed)
        solved, traded = outcome.solved, tables.traded
        if not micro_batch_ok(tg, cinfos, solved.sol.choice, tables.ilp, self.k):
            # the solution splits the batch over more devices than the micro-batches allow: the
            # most micro-batches it does allow (more memory than the rows priced: checked below)
            split = solution_batch_parts(tg, cinfos, solved.sol.choice, tables.ilp)
            fewer = [
                k
                for k in micro_batch_counts(pb.batch, split, stages, options)
                if pb.micro.allows(pb.batch, k, trace=False)
            ]
            if not fewer:
                return Rung(Lesson.NOTHING, None, needed)
            trades = dataclasses.replace(trades, micro_batches=fewer[0])
            traded = self._traded(trades)
        # priced on the step's own tables, not the fullest stage's rows (as autopar.reprice does);
        # the gradient sync reads only their seconds, which the rows (``stage_tables``) keep:
        # solve_mesh's holds unless the micro-batches changed above
        if trades is not solved.trades:
            gs = grad_sync_cost(
                tg, cinfos, traded, solved.sol, solved.choice, sub, run.mesh, options.outputs, trades.micro_batches,
                grad_dtype(trades.precision), zero_one_axes(trades), compute_param_dtype(trades.precision),
            )  # fmt: skip
        else:
            gs = solved.gs
        # the pipelined runtime reduces the buckets after its schedule: nothing hides behind backward
        gs = reduced_after_schedule(gs, CommModel(sub, run.mesh), sub.device.comm_overlap)
        terms = trade_terms(
            self.base, traded, solved.sol.choice, cinfos, trades, sub, options.optimizer, pb.blocks
        )
        solved = dataclasses.replace(solved, gs=gs, terms=terms, trades=trades)
        why: list[str] = []
        price = price_pipeline(
            PipelineProblem(
                tg, cinfos, self.base, traded, solved.sol.choice, solved.choice, pb.blocks, trades, stages,
                pb.cluster, options, pb.limit, gs.adjustment_s + terms.total_s, terms.transient,
                step_transient=gs.step_gathers_bytes(stages),
                sides=partial_sides(self.base, tg, cinfos, trades, sub, options.optimizer, pb.blocks),
            ),
            why=why,
        )  # fmt: skip
        if price is None:
            pb.st.say(f"solve: mesh {run.label} [{trades.describe()}]: no pipeline: {'; '.join(why)}")
            entry = dataclasses.replace(entry, verdict=Verdict.INFEASIBLE, objective=None)
            return Rung(Lesson.TOO_BIG, entry, needed, about=trades)
        entry = dataclasses.replace(entry, objective=price.step_s, pipeline=price.pipeline)
        pb.st.say(
            f"pipeline: mesh {run.label} [{trades.describe()}]: {price.pipeline.describe()}, {self.k} micro-batches, "
            f"predicted step {price.step_s * 1e3:.3f} ms"
        )
        got = dataclasses.replace(solved, t_step=price.step_s, pipe=price, cluster=sub)
        return Rung(Lesson.FITS, entry, needed, got, got.t_step, peak=max(price.peak))


def pipeline_climb(
    pb: Problem, run: MeshRun, sub: ClusterSpec, tables: CostTables, best_objective: float
) -> Climb:
    """Pipeline candidate ``run`` (on ``sub``, its tables ``tables``) down its ladder of trades at
    the fewest micro-batches its data axes and the model allow; no climb where none do."""
    stages, batch = run.stages, pb.batch
    # what a micro-batch must split over: the data axes (a solution that splits the batch on
    # another axis too gets fewer micro-batches: ``PipelineRungs.price``)
    parts = math.prod(run.mesh[a] for a in run.data_axes) if run.data_axes else 1
    ks = [
        k
        for k in micro_batch_counts(batch, parts, stages, pb.options)
        if pb.micro.allows(batch, k, trace=False)  # one-row counts: traced where their plan wins
    ]
    if not ks:
        pb.st.say(f"pipeline: mesh {run.label}: no micro-batch count keeps the model's step: skipped")
        return Climb(best_objective)
    k = ks[0]
    popts = dataclasses.replace(pb.options, micro_batches=k, offload=Offload.NONE)
    rungs = [
        t for t in ladder(popts, run.data_axes, pb.precision, batch, bool(pb.blocks)) if t.zero_stage <= 1
    ]
    return climb(
        rungs, PipelineRungs(pb, run, sub, tables, k, parts), pb.limit, best_objective, partial_blocks(pb, stages)
    )  # fmt: skip


def partial_blocks(pb: Problem, stages: int) -> int:
    """The most repeated blocks one of ``stages`` pipeline stages holds (their even cut), where the
    climb may offer rungs recomputing only part of them (``passes/ladder.py:_partial_rung``); 0
    where recomputation is forced (a forced mode recomputes every block unless its count is
    forced too, which the ladder's rungs then carry)."""
    o = pb.options
    if o.recompute is not None or o.recompute_blocks is not None or not pb.blocks:
        return 0
    return math.ceil(len(pb.blocks) / stages)


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
