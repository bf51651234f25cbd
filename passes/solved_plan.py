"""The ``price`` stage of the search: the chosen solution priced as it runs, as a ``Plan``
(``price_solved``): the placements and collectives of ``passes/price.py:price_plan``, then the
trades (``with_trades``: their seconds, the state bytes they leave, their transients) and the
pipeline (``with_pipeline``: the fullest pipeline rank's step and memory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from autopar.cluster import ClusterSpec
from autopar.options import SearchOptions
from autopar.passes.analyze import NodeInfo
from autopar.passes.experts import has_experts
from autopar.passes.mesh_solve import Solved
from autopar.passes.pipeline import PipelinePrice
from autopar.passes.price import buffers_inputs_bytes, price_plan
from autopar.passes.trace import Role, TracedGraph
from autopar.passes.trade_terms import TradeTerms
from autopar.passes.trades import param_state
from autopar.plan import Plan


def price_solved(
    tg: TracedGraph,
    infos: dict[str, NodeInfo],
    solved: Solved,
    cluster: ClusterSpec,
    options: SearchOptions,
    candidates: Sequence[dict],
) -> Plan:
    """The plan of ``solved`` on ``cluster`` (the whole one: a pipeline's tables were priced on
    one stage's devices, ``solved.cluster``), its nodes priced as ``infos`` say, with its trades,
    its pipeline, the kernels fused into ``tg``, ``candidates`` as the meshes the search tried, and
    the solver's time limit (``options.time_limit_s``, which ``Plan.summary`` names where set)."""
    plan = price_plan(
        tg, infos, solved.tables, solved.sol, solved.choice, solved.cluster or cluster, solved.run.mesh,
        options.optimizer, candidates, solved.bound, solved.gs, options.outputs,
    )  # fmt: skip
    plan = dataclasses.replace(
        with_trades(plan, tg, infos, solved, options),
        kernels=tg.kernels,
        solver=dataclasses.replace(plan.solver, time_limit_s=options.time_limit_s),
        expert_skew=float(options.expert_skew) if has_experts(tg) else None,
    )
    if solved.pipe is not None:
        plan = with_pipeline(plan, solved.pipe, cluster)
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
        bubble_s=price.bubble_s,
        peak_memory_bytes=int(max(price.peak)),
        param_bytes=int(param),
        grad_bytes=int(grad),
        optimizer_bytes=int(opt),
        activation_bytes=int(price.worst_activations),
        # the gradient buckets were priced on the whole model, as the trades: a stage's are 1/S
        grad_sync_hidden_s=p.grad_sync_hidden_s / price.pipeline.stages,
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
