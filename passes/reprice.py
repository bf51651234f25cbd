"""A choice made without the solver, priced as the search prices the solution it chooses.

``autopar.reprice`` prices a plan's decisions, unchanged, on a cluster (another one, or another
calibration). It runs the search's own stages for the one candidate the plan names, the ILP left
out:

* ``given_choice``: the plan replayed on the model (``passes/replay.py``), then the strategies and
  cost tables of the plan's mesh as the search builds a candidate's (on one pipeline stage's
  devices where the plan pipelines, ``passes/pipeline.py``), at the plan's precision, with the
  plan's trades (``passes/trades.py``): one ``MeshProblem``, the value the search's solve stage
  takes (``passes/mesh_solve.py``);
* ``solved_as_searched``: the plan's choice as that stage leaves the solution the ILP finds
  (``priced_solution``: every node's strategy, the gradient buckets, the trades' terms) and, where
  the plan pipelines, its pipeline priced with the plan's schedule and cuts (``price_pipeline``);
* ``price_choice``: that solution priced by the search's price stage (``passes/solved_plan.py:
  price_solved``).

The result's solver status is ``REPRICED``; its objective, the tables' total on the cluster.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from autopar.cluster import ClusterSpec
from autopar.cost_model.comm import CommModel
from autopar.errors import PlanMismatchError
from autopar.options import Optimizer, SearchOptions
from autopar.passes.analyze import analyze
from autopar.passes.blocks import find_blocks
from autopar.passes.candidates import MeshRun
from autopar.passes.costs import NodeTimer, build_costs
from autopar.passes.float8_price import Float8Offer
from autopar.passes.grad_sync import reduced_after_schedule
from autopar.passes.mesh_solve import MeshProblem, Solved, TradeContext, priced_solution
from autopar.passes.pipeline import PipelineProblem, price_pipeline, stage_cluster
from autopar.passes.precision import autocast_device, half_infos
from autopar.passes.replay import choice_from_plan, plan_regions, plan_strategies, traced_as_planned
from autopar.passes.solved_plan import price_solved
from autopar.passes.solver import Solution, objective_s
from autopar.passes.strategies import Strategy
from autopar.passes.trades import apply_trades, partial_sides
from autopar.placement import Outputs
from autopar.plan import Plan

REPRICED = "Repriced"  # the solver status of a plan priced without a search


@dataclass(frozen=True)
class GivenChoice:
    """A plan's decisions on a cluster, with the problem the search would have solved to choose
    them: ``problem`` (its graph, infos, tables with the plan's trades, the tables' devices, the
    plan's mesh, the run's optimizer and the plan's outputs, the trades' context), ``choice``
    (every node's strategy, read from the plan) and ``cluster`` (the whole one: ``problem``'s is
    one pipeline stage's devices where the plan pipelines)."""

    plan: Plan
    problem: MeshProblem
    choice: dict[str, Strategy]
    cluster: ClusterSpec


def given_choice(
    model,
    cluster: ClusterSpec,
    example_inputs,
    plan: Plan,
    optimizer: Optimizer,
    profiler: NodeTimer | None = None,
) -> GivenChoice:
    """The plan replayed on the model and its tables built on ``cluster`` (module docstring);
    PlanMismatchError where the plan was made for another model or number of devices, or its
    pipeline stages split the cluster's nodes unevenly. ``optimizer``: the one the run uses (a plan
    does not record it); ``profiler``: prices ops by running them, else the roofline."""
    plan.check_world(cluster.world_size)
    tg = traced_as_planned(model, example_inputs, plan)
    plan.check_matches(tg.fingerprint(), cluster.world_size)
    infos = analyze(tg)
    regions = plan_regions(model, tg, plan, example_inputs)
    strats = plan_strategies(tg, infos, plan, regions)
    devices = cluster
    if plan.pipeline.enabled:  # the tables price one stage's mesh (passes/pipeline.py)
        devices = stage_cluster(cluster, plan.pipeline.stages)
        if devices is None:
            raise PlanMismatchError(
                f"{plan.pipeline.stages} pipeline stages split the nodes of {cluster.name} unevenly; re-plan for it"
            )
    options = SearchOptions(
        optimizer=optimizer, outputs=Outputs(plan.outputs), expert_skew=plan.expert_skew or 1.0
    )
    mesh = tuple(plan.mesh_shape)
    # as the search priced it (passes/trades.py)
    cinfos = half_infos(tg, infos, plan.trades.precision, autocast_device(devices))
    base = build_costs(
        tg, cinfos, strats, devices, mesh, optimizer, profiler=profiler, outputs=options.outputs,
        overlap_matmuls=plan.overlap_matmuls, float8=Float8Offer.given(plan.float8_linears),
    )  # fmt: skip
    blocks = find_blocks(tg)
    problem = MeshProblem(
        tg=tg,
        infos=cinfos,
        tables=apply_trades(
            base,
            tg,
            cinfos,
            plan.trades,
            devices,
            optimizer,
            blocks,
            plan.pipeline.cuts,
            plan.pipeline.stages,
        ),
        cluster=devices,
        run=MeshRun(mesh, None),
        options=options,
        limit=math.inf,
        trade=TradeContext(plan.trades, base, blocks, cinfos),
    )
    choice = choice_from_plan(tg, plan, regions, allowed=strats)
    return GivenChoice(plan=plan, problem=problem, choice=choice, cluster=cluster)


def solved_as_searched(given: GivenChoice) -> Solved:
    """The given choice as the search's solve stage leaves a solution (``passes/mesh_solve.py``),
    with the plan's pipeline priced as the search prices a pipeline's (``passes/rungs.py``)."""
    p, plan = given.problem, given.plan
    picks = {v: ss.index(given.choice[v]) for v, ss in p.tables.strategies.items()}
    sol = Solution(
        choice=picks,
        objective=objective_s(p.tables, picks),
        status=REPRICED,
        solve_time_s=0.0,
        solver=plan.solver.name,
        num_variables=0,
        num_constraints=0,
    )
    choice, gs, terms = priced_solution(p, sol)
    solved = Solved(
        t_step=sol.objective + gs.adjustment_s + terms.total_s, run=p.run, sol=sol, tables=p.tables, bound=0.0,
        gs=gs, choice=choice, trades=plan.trades, terms=terms, cluster=p.cluster,
    )  # fmt: skip
    if not plan.pipeline.enabled:
        return solved
    # the pipelined runtime reduces the buckets after its schedule, as ``passes/rungs.py`` prices it
    gs = reduced_after_schedule(gs, CommModel(p.cluster, p.run.mesh), p.cluster.device.comm_overlap)
    solved = dataclasses.replace(solved, gs=gs, t_step=sol.objective + gs.adjustment_s + terms.total_s)
    pipe = price_pipeline(
        PipelineProblem(
            tg=p.tg, infos=p.infos, base=p.trade.base, tables=p.tables, picks=picks, choice=choice,
            blocks=p.trade.blocks, trades=plan.trades, stages=plan.pipeline.stages, cluster=given.cluster,
            options=p.options, limit=math.inf, extra_s=gs.adjustment_s + terms.total_s,
            transient=terms.transient, fixed=plan.pipeline, step_transient=gs.step_gathers_bytes(plan.pipeline.stages),
            sides=partial_sides(p.trade.base, p.tg, p.infos, plan.trades, p.cluster, p.options.optimizer, p.trade.blocks),
        )
    )  # fmt: skip
    return dataclasses.replace(solved, t_step=pipe.step_s, pipe=pipe)


def price_choice(given: GivenChoice) -> Plan:
    """The given choice priced by the search's price stage (``price_solved``): the plan's
    decisions, unchanged, with their predicted step and memory on the given cluster."""
    p = given.problem
    return price_solved(
        p.tg, p.infos, solved_as_searched(given), given.cluster, p.options, given.plan.solver.candidates
    )
