"""Solving one candidate of the outer search at one rung of its trades ladder (``solve_mesh``).

In order, each step cheaper than the next and skipping the rest where it decides:

1. the memory lower bound (``passes/memory_row.py:lower_bound_bytes``) against the limit;
2. the time lower bound (``passes/solver.py:lower_bound`` on the exactly folded tables, kept per
   candidate in ``TradeContext.bounds``) against the best objective so far;
3. the ILP (``passes/solver.py:solve``), the best so far as its cutoff: pruned where its LP
   relaxation already passes it;
4. on the chosen solution: the gradient buckets (``passes/price.py:grad_sync_cost``) and the
   trades' terms (``passes/trade_terms.py:trade_terms``), the full peak against the limit (solving
   again, once, with as much less room as that peak passes it and the best so far as its cutoff
   again: the buckets' flattening and the optimizer step's temporaries are not in the ILP's rows),
   the micro-batches' split of the batch and the host memory offload needs.

The outcome is typed (``MeshOutcome``: its ``Entry`` and ``Verdict``, ``passes/outcome.py``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from autopar.cluster import ClusterSpec
from autopar.options import SearchOptions
from autopar.passes.analyze import NodeInfo
from autopar.passes.blocks import Block
from autopar.passes.candidates import MeshRun
from autopar.passes.costs import CostTables
from autopar.passes.dumps import Recorder, Stages, size_text
from autopar.passes.grad_sync import GradSyncCost
from autopar.passes.infeasible import blocked
from autopar.passes.memory_row import lower_bound_bytes
from autopar.passes.outcome import Entry, Verdict
from autopar.passes.pipeline import PipelinePrice
from autopar.passes.precision import compute_param_dtype, grad_dtype
from autopar.passes.price import expanded_choice, grad_sync_cost, plan_peak
from autopar.passes.solver import (
    EXACT_FOLD_MAX_PAIRS,
    Proof,
    Pruned,
    Solution,
    edge_pairs,
    fold_followers,
    lower_bound,
    solve,
)
from autopar.passes.strategies import Strategy
from autopar.passes.trace import TracedGraph
from autopar.passes.trade_terms import TradeTerms, terms_lower_bound, trade_terms, zero_one_axes
from autopar.passes.trades import micro_batch_ok
from autopar.trades import Trades, ZeroStage


@dataclass(frozen=True)
class Solved:
    """A candidate the ILP solved: its predicted step (the tables' objective plus the gradient
    buckets' adjustment and the trades' terms) and what pricing it needs."""

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
    peak: float = 0.0  # the full peak bytes per device solve_mesh held to the limit (0: not priced)


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
        return (t.zero_stage, t.recompute, t.offload, t.precision, t.recompute_blocks)


@dataclass(frozen=True)
class MeshProblem:
    """One ILP of the outer search: candidate ``run`` on ``tables`` (the rung's, priced on
    ``cluster``: the whole one, or one pipeline stage's devices) for the graph ``tg`` whose nodes
    ``infos`` describe as the cost model priced them, under ``options`` and ``limit`` bytes per
    device. ``trade``: the rung of the trades ladder (None: no trades); ``check_micro_batches``:
    refuse a solution that splits the batch over more devices than its micro-batches allow."""

    tg: TracedGraph
    infos: dict[str, NodeInfo]
    tables: CostTables
    cluster: ClusterSpec
    run: MeshRun
    options: SearchOptions
    limit: float
    trade: TradeContext | None = None
    check_micro_batches: bool = True
    # plans of other candidates on this mesh (node -> strategy): where the ILP's LP relaxation
    # prunes it, one of them that is a plan of these tables shows it has a plan (solver.solve)
    hints: tuple[dict[str, Strategy], ...] = ()
    # the memory lower bound of ``tables`` where the caller has it (the trades ladder computes it
    # for every rung, ``passes/ladder.py:_bound``); None: ``solve_mesh`` computes it
    mem_needed: float | None = None


@dataclass(frozen=True)
class MeshOutcome:
    """What solving one candidate gave: its entry, the memory it needs at least, the solution when
    one fits, and whether a plan that fit the ILP's rows failed at its full peak."""

    entry: Entry
    mem_needed: float
    solved: Solved | None = None
    refused_at_full_peak: bool = False
    refused_peak: float = math.inf  # the full peak of the plan refused at it (inf: none was)
    host_needed: float = math.inf  # host bytes per device of a plan refused for host memory (inf: none)

    @property
    def fitted(self) -> bool:
        """Pruned by the ILP's LP relaxation: it has a plan, no better than the best (a rung that
        fits, as far as the trades ladder is concerned: the ILP would have solved it, and lost)."""
        return self.entry.verdict is Verdict.LP_PRUNED


def solve_mesh(p: MeshProblem, best_objective: float = math.inf, st: Stages | None = None) -> MeshOutcome:
    """Solve one candidate (module docstring): skipped where its memory lower bound passes the
    limit or its time lower bound is no better than ``best_objective``; else the ILP, then the
    chosen solution's full price. ``st``: where its lines and dumps go (None: nowhere)."""
    st = st if st is not None else Recorder()
    tables, run, options, limit, ctx = p.tables, p.run, p.options, p.limit, p.trade
    label = run.label
    trades = ctx.trades if ctx else Trades()
    if not trades.is_default:
        label = f"{label} [{trades.describe()}]"
    mem_needed = p.mem_needed if p.mem_needed is not None else lower_bound_bytes(tables)
    exact = None
    if ctx is not None and ctx.bound_key in ctx.bounds:
        bound = ctx.bounds[ctx.bound_key]
    else:
        exact = fold_followers(tables, exact=True)  # keeps the optimum: the bound is valid on it
        bound = lower_bound(tables, exact)
        if ctx is not None:
            ctx.bounds[ctx.bound_key] = bound
    entry = Entry(run.mesh, Verdict.INFEASIBLE, run.roles, lower_bound=bound, trades=trades)

    def ended(verdict: Verdict, refused: float = math.inf, host: float = math.inf, **more) -> MeshOutcome:
        return MeshOutcome(
            replace(entry, verdict=verdict, **more), mem_needed, None, refused < math.inf, refused, host
        )

    if mem_needed > limit:
        st.say(f"solve: mesh {label}: needs >= {mem_needed / 2**30:.2f} GiB per device: skipped")
        return ended(Verdict.INFEASIBLE)
    # pruning compares the tables' totals (the bound is one of those); the overlap adjustment
    # below re-ranks the meshes that get solved
    if bound == math.inf:  # some node has no finite choice: no plan at any memory, name the op
        why = blocked(tables, {n.name: n for n in p.tg.graph.nodes})
        if why is not None:
            st.say(f"solve: mesh {label}: no plan under its axis roles: {why}")
            return ended(Verdict.BLOCKED, blocked=why)
    if bound >= best_objective:
        st.say(f"solve: mesh {label}: lower bound {bound * 1e3:.3f} ms >= best: pruned")
        return ended(Verdict.BOUND_PRUNED)
    # the ILP's tables: only meshes that get solved pay for this fold
    small = edge_pairs(tables) <= EXACT_FOLD_MAX_PAIRS
    folded = exact if small and exact is not None else fold_followers(tables, exact=small)
    # the best so far as a cutoff: where the ILP's LP relaxation already passes it, the ILP itself
    # is not solved (only whether it has a plan: a candidate with none is reported as without the cutoff)
    # the ILP's objective is the tables' alone, the rung's is that plus its trades' terms: the
    # cutoff leaves out the terms' seconds no choice avoids (ZeRO-2/3's exposed gathers and
    # per-micro-batch reduce-scatters, ``terms_lower_bound``), so a relaxation that passes it proves
    # every plan's objective past the best. (Only here: a rung pruned so has a plan, as one pruned
    # by the relaxation alone, and the climb learns the same from it; the time bound above stays
    # the tables' alone, since the rungs it prunes do not end the climb: on DeepSeek-V3 on 256 H100
    # adding the terms there let a (4, 8, 8) climb go on to two infeasible ILPs of 13 and 27 s.)
    extra = (
        terms_lower_bound(tables, ctx.infos, trades, p.cluster, ctx.blocks, ctx.bounds)
        if ctx is not None
        else 0.0
    )
    cutoff = best_objective - extra
    sol = solve(tables, limit, options.time_limit_s, folded=folded, cutoff=cutoff, hints=p.hints)
    if isinstance(sol, Pruned):
        with_terms = f" + {extra * 1e3:.3f} ms of trades" if extra else ""
        what = (
            f"LP relaxation {sol.bound * 1e3:.3f} ms{with_terms} >= best"
            if sol.by is Proof.LP
            else f"its ILP has no plan under the best, {(sol.bound + extra) * 1e3:.3f} ms"
        )
        st.say(f"solve: mesh {label}: {what}: pruned")
        return ended(Verdict.LP_PRUNED, lp_bound=sol.bound + extra)
    if sol is None:
        why = blocked(tables, {n.name: n for n in p.tg.graph.nodes})
        if why is not None:  # no choice at all, whatever the memory: name the op
            st.say(f"solve: mesh {label}: no plan under its axis roles: {why}")
            return ended(Verdict.BLOCKED, blocked=why)
        st.say(f"solve: mesh {label}: no plan fits {limit / 2**30:.2f} GiB per device")
        return ended(Verdict.INFEASIBLE)
    # the full price of the choice (solve evaluates it), with the gradient all-reduces as they run:
    # once per parameter, partly behind backward compute (passes/grad_sync.py)
    choice, gs, terms = priced_solution(p, sol)
    peak = plan_peak(tables, sol, gs) + terms.transient
    if peak > limit:
        # with as much less room as the peak passed the limit by; where the rung's memory lower
        # bound already passes that room, no plan of these tables fits it (every plan's rows hold
        # at least the bound: tests/test_solver.py), so the ILP is not built to say so
        # The best so far is its cutoff too, as in the first solve: a rung whose plans under that
        # room are all no better than the best is pruned as that solve prunes one (DeepSeek-V3 on
        # 512 H100: a free (64, 8) rung re-solved to a plan of 160 s against the best 90 s, 23 s of
        # CPU in branch and bound)
        lower = limit - (peak - limit)
        sol = (
            solve(tables, lower, options.time_limit_s, folded=folded, cutoff=cutoff, hints=p.hints)
            if mem_needed <= lower
            else None
        )
        if isinstance(sol, Pruned):
            st.say(
                f"solve: mesh {label}: under the room its full peak leaves, {lower / 2**30:.2f} GiB, "
                f"no plan under the best, {(sol.bound + extra) * 1e3:.3f} ms: pruned"
            )
            return ended(Verdict.LP_PRUNED, lp_bound=sol.bound + extra)
        if sol is not None:
            choice, gs, terms = priced_solution(p, sol)
            peak = plan_peak(tables, sol, gs) + terms.transient
        if sol is None or peak > limit:
            st.say(
                f"solve: mesh {label}: no plan fits {limit / 2**30:.2f} GiB per device "
                "with its gradient buckets' flattening and its optimizer step's temporaries"
            )
            return ended(Verdict.INFEASIBLE, refused=peak)
    if p.check_micro_batches and not micro_batch_ok(p.tg, p.infos, sol.choice, tables, trades.micro_batches):
        st.say(f"solve: mesh {label}: the batch does not split into its micro-batches as the plan splits it")
        return ended(Verdict.INFEASIBLE)
    host_limit = p.cluster.host_memory_bytes / max(p.cluster.devices_per_node, 1)
    if terms.host_bytes > host_limit:
        st.say(
            f"solve: mesh {label}: offloaded state needs {size_text(terms.host_bytes)} of host memory per device"
        )
        return ended(Verdict.INFEASIBLE, host=terms.host_bytes)
    t_step = sol.objective + gs.adjustment_s + terms.total_s
    cut = ""
    if sol.bound is not None:  # the node limit stopped it: what its tree had not explored
        cut = (
            f"; stopped at its node limit: its ILP's plans between the one taken, objective "
            f"{sol.objective * 1e3:.3f} ms, and the least it proved, {sol.bound * 1e3:.3f} ms, not explored"
            if sol.bound > -math.inf
            else "; stopped at its node limit before its root's bound: its other plans not explored"
        )
    st.say(
        f"solve: mesh {label}: {sol.status}, predicted step {t_step * 1e3:.3f} ms "
        f"({sol.num_variables} variables, {sol.solve_time_s:.2f} s{cut})"
    )
    st.write(
        f"4_solve_{run.tag}.json",
        json.dumps({"status": sol.status, "objective": t_step, "choice": sol.choice}, indent=0),
    )
    return MeshOutcome(
        replace(
            entry, verdict=Verdict.SOLVED, objective=t_step, solver_status=sol.status, ilp_bound=sol.bound
        ),
        mem_needed,
        Solved(t_step, run, sol, tables, bound, gs, choice, trades, terms, peak=peak),
    )


def priced_solution(p: MeshProblem, sol: Solution) -> tuple[dict[str, Strategy], GradSyncCost, TradeTerms]:
    """A solution's placements of every node, its gradient sync and its trades' terms."""
    choice = expanded_choice(p.tg, p.tables, sol)
    ctx = p.trade
    k = ctx.trades.micro_batches if ctx is not None else 1
    gd = grad_dtype(ctx.trades.precision) if ctx is not None else None
    sa = zero_one_axes(ctx.trades) if ctx is not None else ()
    pd = compute_param_dtype(ctx.trades.precision) if ctx is not None else None
    gs = grad_sync_cost(
        p.tg, p.infos, p.tables, sol, choice, p.cluster, p.run.mesh, p.options.outputs, k, gd, sa, pd
    )
    if ctx is None:
        return choice, gs, TradeTerms()
    terms = trade_terms(
        ctx.base, p.tables, sol.choice, ctx.infos, ctx.trades, p.cluster, p.options.optimizer, ctx.blocks
    )
    return choice, replace(gs, fsdp=fsdp_reduced(gs.deferred, ctx.trades, p.run.mesh)), terms


def fsdp_reduced(deferred: dict[str, tuple[int, ...]], trades: Trades, mesh) -> frozenset[str]:
    """The deferred parameters FSDP2 reduces under ``trades`` (``codegen/zero.py:sharded_params``):
    from ZeRO-2, those whose gradient is partial on exactly the data axes of more than one device
    (on one device, where FSDP2 runs for offload, those partial on none)."""
    if trades.zero_stage < ZeroStage.GRADIENTS:
        return frozenset()
    axes = {a for a in trades.data_axes if mesh[a] > 1}
    return frozenset(p for p, on in deferred.items() if set(on) == axes)
