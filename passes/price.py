"""Price a chosen plan: the cost tables' sums, then what only the chosen plan shows.

The ILP's objective prices every node and edge from the cost tables (``passes/costs.py``). Once a
solution is chosen, its step is priced as it will run (``price_plan``):

* gradient buckets (``passes/grad_sync.py:price_grad_sync``): the data-parallel gradients'
  all-reduces, in buckets, partly hidden behind backward compute (``GradSyncCost.adjustment_s``:
  what the timeline differs from the tables' per-use prices);
* the wait for the slowest rank at each synchronizing point (``cost_model/sync.py``): a node whose
  inputs need collectives, a lowering's own collective, the outputs gathered for the caller, the
  gradient buckets when backward ends;
* the step's fixed overhead (``DeviceSpec.step_overhead_s``, times the host's slowdown);
* the peak memory per device with the gradient buckets' flattening and the optimizer step's
  temporaries (``passes/memory_row.py:peak_bytes``).

Per node it records the compute seconds, the seconds and typed records (``PlannedCollective``) of
the collectives that bring its inputs to the placements it takes (``autopar/reshard.py``, as
codegen emits them), its lowering's own collectives, and for a parameter its share of its
gradient bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.fx as fx

from autopar.cluster import ClusterSpec, DeviceSpec
from autopar.cost_model.comm import CommModel
from autopar.cost_model.sync import SyncNode, sync_wait_s
from autopar.lowerings import describe
from autopar.lowerings.matmul_nd import is_grid
from autopar.options import Optimizer
from autopar.passes.analyze import NodeInfo
from autopar.passes.costs import CostTables, resolve_source
from autopar.passes.grad_sync import (
    Bucket,
    GradSyncCost,
    bucket_all_reduce_s,
    bucket_transients,
    plan_uses,
    price_grad_sync,
    use_run_s,
)
from autopar.passes.memory_row import peak_bytes
from autopar.passes.op_price import lowering_collectives
from autopar.passes.solver import Solution, objective_s
from autopar.passes.strategies import Strategy
from autopar.passes.trace import Role, TracedGraph, module_path
from autopar.passes.use_price import deferred_output, use_fusions
from autopar.placement import Outputs, spec_to_str, via_to_str, volume_factor
from autopar.plan import NodeDecision, Plan, PlannedCollective, Predicted, Site, SolverInfo
from autopar.reshard import Collective, CollectiveCall, Phase


def plan_peak(tables: CostTables, sol: Solution, gs: GradSyncCost) -> float:
    """The plan's peak bytes per device: the tables' liveness, the gradient buckets' flattening,
    the optimizer step's temporaries and ZeRO-1's gathers in flight after it."""
    extra = bucket_transients(gs.buckets, gs.fsdp)
    if gs.step_gathers_bytes():  # ZeRO-1's gathers in flight after the step, the gradients still held
        pos = tables.step_position
        extra[pos] = max(extra.get(pos, 0.0), gs.step_gathers_bytes())
    return peak_bytes(tables, sol.choice, extra, set(gs.deferred))


def expanded_choice(tg: TracedGraph, tables: CostTables, sol: Solution) -> dict[str, Strategy]:
    """Every node's strategy: its class representative's, getitems their producer's."""
    members = tables.classes.members
    return _with_getitems(tg, {m: tables.strategies[v][i] for v, i in sol.choice.items() for m in members[v]})


def _node_compute(tables: CostTables, sol: Solution, node: str) -> float:
    """Seconds of one node's compute (forward + backward, or its optimizer step) in the solution."""
    classes = tables.classes
    rep = classes.rep.get(node)
    return tables.node_cost[rep][sol.choice[rep]] / classes.count(rep) if rep else 0.0


def grad_sync_cost(
    tg,
    infos,
    tables: CostTables,
    sol: Solution,
    choice,
    cluster: ClusterSpec,
    mesh,
    outputs: Outputs,
    micro_batches: int = 1,
    grad_dtype: torch.dtype | None = None,
    scatter_axes: tuple[int, ...] = (),
    gather_dtype: torch.dtype | None = None,
) -> GradSyncCost:
    """The solution's gradient buckets on the backward timeline (``price_grad_sync``; with
    ``micro_batches``, that of the last micro-batch, which alone reduces; ``grad_dtype``: the
    gradients' dtype at run time, ``passes/precision.py:grad_dtype``; ``scatter_axes``: ZeRO-1's,
    ``passes/trade_terms.py:zero_one_axes``; ``gather_dtype``: what ZeRO-1's gathers send,
    ``passes/precision.py:compute_param_dtype``)."""
    compute = {n: _node_compute(tables, sol, n) for n in choice}
    comm = CommModel(cluster, mesh)
    return price_grad_sync(
        tg, infos, choice, compute, comm, cluster.device.comm_overlap, outputs, tuple(tables.bucket_fixed),
        chosen_matmul_s(tables, sol), micro_batches, grad_dtype, scatter_axes, gather_dtype,
    )  # fmt: skip


def chosen_matmul_s(tables: CostTables, sol: Solution) -> Callable[[fx.Node], float] | None:
    """Each linear's compute (one member's, forward + backward) under the solution, as the tables
    price it, for the collective matmuls the plan runs (``passes/collective_matmul.py``); None
    where the tables price none (``overlap_matmuls`` off)."""
    if not tables.overlap_matmuls:
        return None
    rep = tables.classes.rep if tables.classes else {}

    def matmul_s(linear: fx.Node) -> float:
        r = rep.get(linear.name, linear.name)
        return tables.matmul_s[r][sol.choice[r]]

    return matmul_s


def _with_getitems(tg: TracedGraph, choice: dict[str, Strategy]) -> dict[str, Strategy]:
    out = dict(choice)
    for n in tg.graph.nodes:
        if n.op == "call_function" and n.name not in out:
            src = resolve_source(n)
            if src.name in choice:
                out[n.name] = Strategy(choice[src.name].out, (choice[src.name].out,))
    return out


def _owner(info: NodeInfo) -> str:
    """The module path of a parameter's or buffer's owner (its FQN less the last name); "" for a
    user input."""
    return info.target.rpartition(".")[0] if info.role in (Role.PARAM, Role.BUFFER) else ""


def price_plan(
    tg: TracedGraph,
    infos: dict[str, NodeInfo],
    tables: CostTables,
    sol: Solution,
    choice: dict[str, Strategy],
    cluster: ClusterSpec,
    mesh: tuple[int, ...],
    optimizer: Optimizer,
    candidates: Sequence[dict],
    bound: float,
    gs: GradSyncCost,
    outputs: Outputs,
) -> Plan:
    """The plan of solution ``sol`` on ``mesh``, priced as it runs (module docstring):
    ``candidates``, the meshes the search tried; ``bound``, the chosen mesh's lower bound;
    ``gs``, its gradient buckets (``grad_sync_cost``)."""
    comm = CommModel(cluster, mesh)
    comm_in, colls, out_colls = _node_collectives(
        tg, infos, choice, comm, gs.deferred, gs.buckets, outputs, chosen_matmul_s(tables, sol)
    )
    decisions = []
    off_path: set[tuple[str, int]] = set()  # (node, index in its collectives) of deferred calls
    param_b = grad_b = 0.0
    compute = 0.0
    for n in tg.graph.nodes:
        if n.op not in ("placeholder", "call_function") or n.name not in choice:
            continue
        info = infos[n.name]
        s = choice[n.name]
        # the collectives a lowering runs inside the op are in its table cost: communication here
        inside = lowering_collectives(n, s, comm, info=info) if n.op == "call_function" else []
        if inside:  # a returned loss's sums run off the step's path (``LoweringCall.deferred``)
            first = len(colls.get(n.name, ()))
            calls = describe(n, s, mesh).calls
            off_path.update((n.name, first + i) for i, c in enumerate(calls) if c.deferred)
        # their seconds as the tables priced them (a ring's hops against its compute, passes/costs.py)
        rep = tables.classes.rep.get(n.name) if tables.classes else n.name
        recipe = tables.float8[rep][sol.choice[rep]] if rep in tables.float8 else None
        if recipe is not None:  # an FP8 linear's amax all-reduces (autopar/lowerings/float8.py)
            inside = lowering_collectives(n, s, comm, recipe=recipe)
        inside_s = tables.node_inside[rep][sol.choice[rep]] if rep in tables.node_inside else 0.0
        cost = _node_compute(tables, sol, n.name) - inside_s
        vol = volume_factor(s.out, mesh)
        if info.role is Role.PARAM:
            param_b += info.out_bytes / vol
            grad_b += info.out_bytes / vol if info.requires_grad else 0.0
        compute += cost
        decisions.append(
            NodeDecision(
                name=n.name,
                op="placeholder" if n.op == "placeholder" else str(n.target),
                role=info.role.value,
                target=info.target if n.op == "placeholder" else "",
                shape=info.shape,
                output=spec_to_str(s.out),
                inputs=tuple(spec_to_str(x) for x in s.ins),
                compute_s=cost,
                comm_s=comm_in.get(n.name, 0.0) + inside_s,
                collectives=tuple(colls.get(n.name, ()))
                + tuple(PlannedCollective.of(call, Site.INSIDE) for call, _ in inside),
                via=via_to_str(s.via),
                module=module_path(n) if n.op != "placeholder" else _owner(info),
                float8=recipe.value if recipe is not None else "",
            )
        )
    t_step = objective_s(tables, sol.choice)
    mem = plan_peak(tables, sol, gs)
    overhead = cluster.device.step_overhead_s * cluster.compute_slowdown  # the same for every plan
    compute += overhead
    t_step += (
        gs.adjustment_s
        + overhead
        + _sync_wait(decisions, cluster.device, out_colls, bool(gs.buckets), off_path)
    )
    comm = t_step - compute
    opt_b = grad_b * optimizer.value
    act_b = mem - param_b - grad_b - opt_b - buffers_inputs_bytes(infos, choice, mesh)
    predicted = Predicted(
        step_time_s=t_step,
        peak_memory_bytes=int(mem),
        compute_s=compute,
        comm_s=max(comm, 0.0),
        param_bytes=int(param_b),
        grad_bytes=int(grad_b),
        optimizer_bytes=int(opt_b),
        activation_bytes=int(max(act_b, 0.0)),
        grad_sync_hidden_s=gs.hidden_s,
    )
    return Plan(
        fingerprint=tg.fingerprint(),
        model=tg.model_name,
        cluster=cluster.to_dict(),
        mesh_shape=tuple(mesh),
        decisions=tuple(decisions),
        predicted=predicted,
        outputs=outputs.value,
        overlap_matmuls=tables.overlap_matmuls,
        solver=SolverInfo(
            name=sol.solver,
            status=sol.status,
            objective=sol.objective,
            solve_time_s=sol.solve_time_s,
            num_variables=sol.num_variables,
            num_constraints=sol.num_constraints,
            candidates=tuple(candidates),
            lower_bound_s=bound,
        ),
    )


def _sync_wait(
    decisions: list[NodeDecision],
    device: DeviceSpec,
    output_collectives: Sequence[CollectiveCall],
    buckets: bool,
    off_path: set[tuple[str, int]] = frozenset(),
) -> float:
    """Seconds the plan's step waits for the slowest rank at its collectives (cost_model/sync.py):
    each node's, the outputs' when forward ends, the gradient buckets' when backward ends; not the
    deferred ones (``off_path``: (node, index in its collectives), a returned loss's sums, which
    nothing in the step waits for)."""

    def c(calls: Iterable[CollectiveCall | PlannedCollective]) -> float | None:
        kinds = [call.kind.value for call in calls]
        return max(device.sync_wait_for(k) for k in kinds) if kinds else None

    def where(call: PlannedCollective) -> str:
        if call.site is Site.BUCKET:  # a gradient bucket's member: the buckets' point
            return ""
        if call.phase is Phase.BACKWARD:
            return "backward"
        return "inside" if call.site is Site.INSIDE else "inputs"

    nodes = [
        SyncNode(
            d.compute_s,
            *(
                c(n for i, n in enumerate(d.collectives) if where(n) == w and (d.name, i) not in off_path)
                for w in ("inputs", "inside", "backward")
            ),
        )
        for d in decisions
    ]
    # the caller's outputs need no gradient
    outputs = c(call for call in output_collectives if call.phase is Phase.FORWARD)
    return sync_wait_s(nodes, outputs, device.sync_wait_for("all_reduce") if buckets else None)


def _node_collectives(
    tg: TracedGraph,
    infos,
    choice: dict[str, Strategy],
    comm: CommModel,
    deferred,
    buckets: Sequence[Bucket],
    outputs: Outputs,
    matmul_s=None,
):
    """Per node: seconds and records of the collectives that bring its inputs to the placements it
    takes (priced as in the cost tables' edges, but per graph edge, not per class of edges; a
    reshard several uses share is listed on the first; what a collective matmul hides of them
    taken out, ``use_run_s``); a parameter's ``deferred`` gradient
    all-reduce is listed on the parameter, with its share of its bucket's seconds. And the
    collectives that bring the graph's outputs to the caller (priced by the tables, listed on no
    node)."""
    seconds: dict[str, float] = {}
    calls: dict[str, list[PlannedCollective]] = {}
    out_calls: list[CollectiveCall] = []
    for u in plan_uses(tg, choice, deferred, outputs):
        if not u.runs or u.user.op not in ("call_function", "output"):
            continue
        info = infos[u.inp.name]
        c, called = comm.reshard(choice[u.src].out, u.need, info.moved_bytes, info.requires_grad, u.fops)
        if u.user.op == "call_function":
            c = use_run_s(u, infos, choice, comm, matmul_s)
            if matmul_s is not None:  # a collective matmul's re-gather in backward (collective_matmul.py)
                state = infos[u.src].role in (Role.PARAM, Role.BUFFER)
                grid = (is_grid(choice[u.src]), is_grid(choice[u.user.name]))
                fused = use_fusions(
                    comm, u.user, u.k, u.inp, choice[u.src].out, u.need, info.moved_bytes, u.fops,
                    choice[u.user.name].out, state, grid,
                )  # fmt: skip
                called = (*called, *(x for f in fused for x in f.extra_calls(info.requires_grad)))
        if u.user.op == "output":
            if not deferred_output(called):  # a deferred sum: no wait at the forward's end
                out_calls.extend(called)
        elif called:
            n = u.user.name
            seconds[n] = seconds.get(n, 0.0) + c
            calls.setdefault(n, []).extend(PlannedCollective.of(call, Site.INPUTS) for call in called)
    for k, b in enumerate(buckets):
        t = bucket_all_reduce_s(b, comm)[0]
        for p in b.params:  # each member's share of its bucket, by bytes
            seconds[p] = t * infos[p].out_bytes / volume_factor(choice[p].out, comm.mesh_shape) / b.nbytes
            calls[p] = bucket_collectives(b, k, comm.mesh_shape)
    return seconds, calls, out_calls


def bucket_collectives(bucket: Bucket, k: int, mesh_shape) -> list[PlannedCollective]:
    """The collectives of gradient bucket ``k`` as the runtime issues them and
    ``bucket_all_reduce_s`` prices them: an all-reduce of its bytes per axis, or where it is
    reduce-scattered into ZeRO-1's shares (``Bucket.scatter``), a reduce-scatter per axis in mesh
    order, each on what the one before left (``1/n`` of it)."""
    if not bucket.scatter:
        return [
            PlannedCollective(Collective.ALL_REDUCE, a, bucket.nbytes, Phase.BACKWARD, Site.BUCKET, k)
            for a in bucket.axes
        ]
    out, nbytes = [], bucket.nbytes
    for a in sorted(bucket.axes):
        out.append(PlannedCollective(Collective.REDUCE_SCATTER, a, nbytes, Phase.BACKWARD, Site.BUCKET, k))
        nbytes /= mesh_shape[a]
    return out


def buffers_inputs_bytes(infos: dict[str, NodeInfo], choice, mesh) -> float:
    """Bytes per device of the buffers and inputs under ``choice``."""
    return sum(
        infos[v].out_bytes / volume_factor(s.out, mesh)
        for v, s in choice.items()
        if infos[v].role in (Role.BUFFER, Role.INPUT)
    )
