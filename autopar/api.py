"""Public API: ``plan`` (offline search) and ``autoparallelize`` (search or apply, then run).

The pipeline is one function of named steps, ``search``; each step's output can be dumped for
debugging with ``dump_dir=...`` (or the ``AUTOPAR_DUMP_DIR`` environment variable):

    trace -> analyze -> strategies -> cost -> solve -> plan          (then, on ranks: codegen)
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.cluster import ClusterSpec, DeviceSpec
from autopar.cost_model.comm import CommModel, axis_link
from autopar.cost_model.profiler import OpProfiler, resolve_profiler
from autopar.cost_model.sync import SyncNode, sync_wait_s
from autopar.errors import DistributedSetupError, NoPlanFitsError, PlanFormatError
from autopar.passes.analyze import NodeInfo, analyze
from autopar.passes.coarsen import find_classes
from autopar.passes.costs import CostTables, Optimizer, build_costs, lowering_collectives, resolve_source
from autopar.passes.grad_sync import (
    Bucket,
    GradSyncCost,
    bucket_all_reduce_s,
    bucket_transients,
    plan_uses,
    price_grad_sync,
)
from autopar.passes.memory_row import lower_bound_bytes, peak_bytes
from autopar.passes.solver import (
    EXACT_FOLD_MAX_PAIRS,
    Solution,
    edge_pairs,
    fold_followers,
    lower_bound,
    mesh_candidates,
    objective_s,
    solve,
)
from autopar.passes.strategies import AxisRole, Strategy, build_strategies, variable_nodes
from autopar.passes.trace import Role, TracedGraph, normalize_inputs, trace
from autopar.placement import Outputs, spec_from_str, spec_to_str, volume_factor
from autopar.plan import NodeDecision, Plan, Predicted, SolverInfo

log = logging.getLogger("autopar")

# meshes of up to this many axes are searched when no mesh shape or axis roles are given
MAX_MESH_AXES = 3
# in that search, a mesh of this many axes or more has its outer axis (the slowest links, across
# nodes when the mesh spans nodes) data parallel: every node's placement on it is fixed to the
# data-parallel solution of that axis alone, so the strategy tables are those of the other axes.
# Free, the tables of a 3-axis mesh grow as (options per axis)^6 per edge. A mesh_shape passed
# explicitly is searched without this restriction.
DATA_OUTER_MIN_AXES = 3


@dataclass
class SearchResult:
    plan: Plan
    traced: TracedGraph
    choice: dict[str, Strategy]


def _progress(fn: Callable[[str], None] | None, msg: str) -> None:
    log.info(msg)
    if fn is not None:
        fn(msg)


def search(
    model: torch.nn.Module,
    cluster: ClusterSpec,
    example_inputs,
    *,
    mesh_shape: Sequence[int] | None = None,
    memory_limit_bytes: float | None = None,
    time_limit_s: float | None = None,
    axis_roles: Sequence[AxisRole] | None = None,
    optimizer: Optimizer = Optimizer.ADAM,
    progress: Callable[[str], None] | None = None,
    dump_dir: str | os.PathLike | None = None,
    coarsen: bool = True,
    profile: bool | OpProfiler = False,
    outputs: Outputs = Outputs.FULL,
) -> SearchResult:
    """``outputs``: whether the module returns each output whole on every rank (``Outputs.FULL``,
    the default: what the single-device model returns) or as this rank's piece (``Outputs.LOCAL``:
    no gathered logits; see ``autopar.placement.Outputs``). ``profile``: True (or an
    ``OpProfiler``) prices ops by running them on this machine's device (cached, see
    ``cost_model.profiler``) instead of the analytical roofline; the cluster's device must be this
    machine's kind, else ProfilerDeviceError. ``memory_limit_bytes``: the memory per device
    (default: ``cluster.device.memory_bytes``); the plan's predicted peak stays under it less
    ``cluster.memory_reserve`` (10% by default: fragmentation, workspaces, the model's error)."""
    profiler = resolve_profiler(profile, cluster, progress)
    dump_dir = dump_dir or os.environ.get("AUTOPAR_DUMP_DIR")
    dump = Path(dump_dir) if dump_dir else None
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    # -- trace ----------------------------------------------------------------------------------
    tg = trace(model, example_inputs, stack_traces=dump is not None)
    _progress(
        progress, f"trace: {len(tg.graph.nodes)} nodes with {tg.tracer} ({time.perf_counter() - t0:.1f} s)"
    )
    if dump:
        (dump / "1_trace.py").write_text(tg.graph_module.code)

    # -- analyze --------------------------------------------------------------------------------
    infos = analyze(tg)
    if dump:
        _dump_infos(dump / "2_analyze.tsv", infos)
    # -- coarsen: repeated-block twins share their ILP variables -----------------------------------
    classes = find_classes(tg, infos, variable_nodes(tg)) if coarsen else None
    if classes is not None:
        _progress(progress, f"coarsen: {len(classes.rep)} nodes in {len(classes.members)} classes")

    # the memory a plan may use: the device's (or the explicit limit), less the cluster's reserve
    limit = cluster.memory_limit(memory_limit_bytes)
    if mesh_shape is not None:
        meshes = [tuple(int(x) for x in mesh_shape)]
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

    best: tuple[float, tuple, Solution, CostTables, float, GradSyncCost, dict] | None = None
    best_objective = math.inf
    candidates = []
    min_needed = math.inf
    refused_at_full_peak = False
    mirrors: dict[tuple, tuple] = {}
    only = set(classes.members) if classes else None
    data_axis: dict[int, dict[str, Strategy]] = {}  # data-parallel solution of one axis, by size
    # without roles, each mesh of fewer axes is searched twice: free, and with axis 0 data parallel
    # (the ILP prices a weight's gradient all-reduce as a bucket share only on a data axis, so the
    # free search overprices data parallelism; see passes/costs.py:bucketed_axes)
    runs = [(m, False) for m in meshes]
    if not axis_roles:
        runs = [(m, dp) for m in meshes for dp in (False, True) if not dp or len(m) < DATA_OUTER_MIN_AXES]
    for mesh, data_first in runs:
        roles = tuple(axis_roles) if axis_roles else None
        data_outer = roles is None and mesh_shape is None and len(mesh) >= DATA_OUTER_MIN_AXES
        if data_outer or data_first:
            roles = (AxisRole.DATA,) + (AxisRole.AUTO,) * (len(mesh) - 1)
            label = f"{mesh} (axis 0 data parallel)"
        else:
            label = f"{mesh}"
        # a mesh whose axes are another's, permuted, each on the same kind of link (and role), is the same problem
        links = [axis_link(cluster, mesh, a) for a in range(len(mesh))]
        key = tuple(
            sorted(
                (n, link.bandwidth, link.latency, roles[a].value if roles else "")
                for a, (n, link) in enumerate(zip(mesh, links))
            )
        )
        if key in mirrors:
            candidates.append(
                {"mesh_shape": list(mesh), "status": f"same as {mirrors[key]}", "objective": None}
            )
            _progress(
                progress, f"solve: mesh {label}: the same problem as mesh {mirrors[key]} (axes permuted)"
            )
            continue
        mirrors[key] = mesh
        # -- strategies ---------------------------------------------------------------------------
        fixed = None
        if data_outer:
            if mesh[0] not in data_axis:
                data_axis[mesh[0]] = _data_parallel_axis(
                    tg, infos, cluster, mesh[0], optimizer, classes, profiler
                )
            fixed = {0: data_axis[mesh[0]]}
        try:
            strats = build_strategies(tg, infos, mesh, roles, only=only, fixed=fixed)
        except NoPlanFitsError as e:
            if not data_first:
                raise
            candidates.append(
                {
                    "mesh_shape": list(mesh),
                    "axis_roles": [r.value for r in roles],
                    "status": "no data-parallel placement",
                    "objective": None,
                }
            )
            _progress(progress, f"solve: mesh {label}: skipped ({e})")
            continue
        # -- cost -----------------------------------------------------------------------------------
        tables = build_costs(tg, infos, strats, cluster, mesh, optimizer, roles, classes, profiler, outputs)
        if profiler is not None:
            _progress(progress, f"profile: mesh {mesh}: {profiler.take_stats().line()}")
        mem_needed = lower_bound_bytes(tables)
        min_needed = min(min_needed, mem_needed)
        exact = fold_followers(tables, exact=True)  # keeps the optimum: the bound is valid on it
        bound = lower_bound(tables, exact)
        entry = {"mesh_shape": list(mesh), "lower_bound": bound}
        if roles:
            entry["axis_roles"] = [r.value for r in roles]
        if mem_needed > limit:
            candidates.append({**entry, "status": "infeasible", "objective": None})
            _progress(
                progress, f"solve: mesh {label}: needs >= {mem_needed / 2**30:.2f} GiB per device: skipped"
            )
            continue
        # pruning compares the tables' totals (the bound is one of those); the overlap adjustment
        # below re-ranks the meshes that get solved
        if bound >= best_objective:
            candidates.append({**entry, "status": "pruned", "objective": None})
            _progress(progress, f"solve: mesh {label}: lower bound {bound * 1e3:.3f} ms >= best: pruned")
            continue
        # -- solve ----------------------------------------------------------------------------------
        # the ILP's tables: only meshes that get solved pay for this fold
        folded = exact if edge_pairs(tables) <= EXACT_FOLD_MAX_PAIRS else fold_followers(tables, exact=False)
        sol = solve(tables, limit, time_limit_s, folded=folded)
        if sol is None:
            candidates.append({**entry, "status": "infeasible", "objective": None})
            _progress(progress, f"solve: mesh {label}: no plan fits {limit / 2**30:.2f} GiB per device")
            continue
        # the full price of the choice (solve evaluates it), with the gradient all-reduces as they run:
        # once per parameter, partly behind backward compute (passes/grad_sync.py)
        choice = _expanded_choice(tg, tables, sol)
        gs = _grad_sync_cost(tg, infos, tables, sol, choice, cluster, mesh, outputs)
        over = _peak(tables, sol, gs) - limit
        if over > 0:
            # flattening a gradient bucket (not in the ILP's rows: the buckets follow from the
            # choice) or the optimizer step's temporaries (not in them either) pass the limit:
            # solve again with that much less room, once
            sol = solve(tables, limit - over, time_limit_s, folded=folded)
            if sol is not None:
                choice = _expanded_choice(tg, tables, sol)
                gs = _grad_sync_cost(tg, infos, tables, sol, choice, cluster, mesh, outputs)
            if sol is None or _peak(tables, sol, gs) > limit:
                refused_at_full_peak = True
                candidates.append({**entry, "status": "infeasible", "objective": None})
                _progress(
                    progress,
                    f"solve: mesh {label}: no plan fits {limit / 2**30:.2f} GiB per device "
                    "with its gradient buckets' flattening and its optimizer step's temporaries",
                )
                continue
        t_step = sol.objective + gs.adjustment_s
        best_objective = min(best_objective, sol.objective)
        candidates.append({**entry, "status": sol.status, "objective": t_step})
        _progress(
            progress,
            f"solve: mesh {label}: {sol.status}, predicted step {t_step * 1e3:.3f} ms "
            f"({sol.num_variables} variables, {sol.solve_time_s:.2f} s)",
        )
        if dump:
            (dump / f"4_solve_{'x'.join(map(str, mesh))}.json").write_text(
                json.dumps({"status": sol.status, "objective": t_step, "choice": sol.choice}, indent=0)
            )
        if best is None or t_step < best[0] - 1e-12:
            best = (t_step, mesh, sol, tables, bound, gs, choice)
    if best is None:
        raise NoPlanFitsError(
            f"no plan fits: needs at least {min_needed / 2**30:.2f} GiB per device, the limit is "
            f"{limit / 2**30:.2f} GiB ({cluster.device.name}, {cluster.world_size} devices, "
            f"{cluster.memory_reserve:.0%} of memory held in reserve"
            f"{'; a plan that fit did not with its gradient buckets flattened and its optimizer step' if refused_at_full_peak else ''}"
            "); try more devices, "
            "a smaller batch or sequence, another mesh_shape or a larger memory_limit_bytes"
        )
    _, mesh, sol, tables, bound, gs, choice = best
    # -- plan -------------------------------------------------------------------------------------
    plan = _make_plan(
        tg, infos, tables, sol, choice, cluster, mesh, optimizer, candidates, bound, gs, outputs
    )
    if dump:
        plan.save(dump / "5_plan.json")
    _progress(progress, f"plan: mesh {mesh}, {time.perf_counter() - t0:.1f} s in all")
    return SearchResult(plan, tg, choice)


def _data_parallel_axis(
    tg: TracedGraph,
    infos: dict[str, NodeInfo],
    cluster: ClusterSpec,
    size: int,
    optimizer: Optimizer,
    classes,
    profiler: OpProfiler | None = None,
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


def _peak(tables: CostTables, sol: Solution, gs: GradSyncCost) -> float:
    """The plan's peak bytes per device: the tables' liveness, the gradient buckets' flattening and
    the optimizer step's temporaries."""
    return peak_bytes(tables, sol.choice, bucket_transients(gs.buckets), set(gs.deferred))


def _expanded_choice(tg: TracedGraph, tables: CostTables, sol: Solution) -> dict[str, Strategy]:
    """Every node's strategy: its class representative's, getitems their producer's."""
    members = tables.classes.members
    return _with_getitems(tg, {m: tables.strategies[v][i] for v, i in sol.choice.items() for m in members[v]})


def _node_compute(tables: CostTables, sol: Solution, node: str) -> float:
    """Seconds of one node's compute (forward + backward, or its optimizer step) in the solution."""
    classes = tables.classes
    rep = classes.rep.get(node)
    return tables.node_cost[rep][sol.choice[rep]] / classes.count(rep) if rep else 0.0


def _grad_sync_cost(
    tg, infos, tables: CostTables, sol: Solution, choice, cluster: ClusterSpec, mesh, outputs: Outputs
) -> GradSyncCost:
    compute = {n: _node_compute(tables, sol, n) for n in choice}
    comm = CommModel(cluster, mesh)
    return price_grad_sync(
        tg, infos, choice, compute, comm, cluster.device.comm_overlap, outputs, tuple(tables.bucket_fixed)
    )


def _with_getitems(tg: TracedGraph, choice: dict[str, Strategy]) -> dict[str, Strategy]:
    out = dict(choice)
    for n in tg.graph.nodes:
        if n.op == "call_function" and n.name not in out:
            src = resolve_source(n)
            if src.name in choice:
                out[n.name] = Strategy(choice[src.name].out, (choice[src.name].out,))
    return out


def _make_plan(
    tg, infos, tables, sol, choice, cluster, mesh, optimizer, candidates, bound, gs, outputs
) -> Plan:
    comm = CommModel(cluster, mesh)
    comm_in, colls, out_colls = _node_collectives(tg, infos, choice, comm, gs.deferred, gs.buckets, outputs)
    decisions = []
    param_b = grad_b = 0.0
    compute = 0.0
    for n in tg.graph.nodes:
        if n.op not in ("placeholder", "call_function") or n.name not in choice:
            continue
        info = infos[n.name]
        s = choice[n.name]
        # the collectives a lowering runs inside the op are in its table cost: communication here
        inside = lowering_collectives(n, s, comm) if n.op == "call_function" else []
        inside_s = sum(t for _, t in inside)
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
                collectives=tuple(colls.get(n.name, ())) + tuple(name for name, _ in inside),
            )
        )
    t_step = objective_s(tables, sol.choice)
    mem = _peak(tables, sol, gs)
    overhead = cluster.device.step_overhead_s * cluster.compute_slowdown  # the same for every plan
    compute += overhead
    t_step += gs.adjustment_s + overhead + _sync_wait(decisions, cluster.device, out_colls, bool(gs.buckets))
    comm = t_step - compute
    opt_b = grad_b * optimizer.value
    act_b = mem - param_b - grad_b - opt_b - _buffers_inputs(infos, choice, mesh)
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
    decisions: list[NodeDecision], device: DeviceSpec, output_collectives: Sequence[str], buckets: bool
) -> float:
    """Seconds the plan's step waits for the slowest rank at its collectives (cost_model/sync.py):
    each node's, the outputs' when forward ends, the gradient buckets' when backward ends."""

    def c(names: Iterable[str]) -> float | None:
        # names as CommModel.reshard lists them: "all_gather@0", "all_reduce(bwd)@1", ...
        kinds = [name.split("@")[0].split("(")[0] for name in names]
        return max(device.sync_wait_for(k) for k in kinds) if kinds else None

    def where(name: str) -> str:
        if "overlapped" in name:  # a gradient bucket's member: the buckets' point
            return ""
        return "backward" if "(bwd)" in name else "inside" if "(in op)" in name else "inputs"

    nodes = [
        SyncNode(
            d.compute_s,
            *(c(n for n in d.collectives if where(n) == w) for w in ("inputs", "inside", "backward")),
        )
        for d in decisions
    ]
    outputs = c(n for n in output_collectives if "(bwd)" not in n)  # the caller's outputs need no gradient
    return sync_wait_s(nodes, outputs, device.sync_wait_for("all_reduce") if buckets else None)


def _node_collectives(
    tg: TracedGraph,
    infos,
    choice: dict[str, Strategy],
    comm: CommModel,
    deferred,
    buckets: Sequence[Bucket],
    outputs: Outputs,
):
    """Per node: seconds and names of the collectives that bring its inputs to the placements it
    takes (priced as in the cost tables' edges, but per graph edge, not per class of edges; a
    reshard several uses share is listed on the first); a parameter's ``deferred`` gradient
    all-reduce is listed on the parameter, with its share of its bucket's seconds. And the names
    of the collectives that bring the graph's outputs to the caller (priced by the tables, listed
    on no node)."""
    seconds: dict[str, float] = {}
    names: dict[str, list[str]] = {}
    out_names: list[str] = []
    for u in plan_uses(tg, choice, deferred, outputs):
        if not u.runs or u.user.op not in ("call_function", "output"):
            continue
        info = infos[u.inp.name]
        c, called = comm.reshard(choice[u.src].out, u.need, info.out_bytes, info.requires_grad, u.fops)
        if u.user.op == "output":
            out_names.extend(called)
        elif called:
            n = u.user.name
            seconds[n] = seconds.get(n, 0.0) + c
            names.setdefault(n, []).extend(called)
    for k, b in enumerate(buckets):
        t = bucket_all_reduce_s(b, comm)[0]
        for p in b.params:  # each member's share of its bucket, by bytes
            seconds[p] = t * infos[p].out_bytes / volume_factor(choice[p].out, comm.mesh_shape) / b.nbytes
            names[p] = [f"all_reduce(axis {a}, overlapped, bucket {k})" for a in b.axes]
    return seconds, names, out_names


def _buffers_inputs(infos: dict[str, NodeInfo], choice, mesh) -> float:
    return sum(
        infos[v].out_bytes / volume_factor(s.out, mesh)
        for v, s in choice.items()
        if infos[v].role in (Role.BUFFER, Role.INPUT)
    )


def _dump_infos(path: Path, infos: dict[str, NodeInfo]) -> None:
    rows = ["name\trole\ttarget\tshape\tdtype\tflops\tbytes\trequires_grad"]
    for i in infos.values():
        rows.append(
            f"{i.name}\t{i.role.value}\t{i.target}\t{i.shape}\t{i.dtype}\t{i.flops:.0f}\t{i.bytes}\t{i.requires_grad}"
        )
    path.write_text("\n".join(rows) + "\n")


def plan(
    model: torch.nn.Module,
    cluster: ClusterSpec,
    example_inputs,
    *,
    mesh_shape: Sequence[int] | None = None,
    memory_limit_bytes: float | None = None,
    time_limit_s: float | None = None,
    axis_roles: Sequence[AxisRole] | None = None,
    optimizer: Optimizer = Optimizer.ADAM,
    progress: Callable[[str], None] | None = None,
    dump_dir: str | os.PathLike | None = None,
    profile: bool | OpProfiler = False,
    outputs: Outputs = Outputs.FULL,
) -> Plan:
    """Search a sharding plan offline: no process group needed; works on meta-device models.
    ``profile=True`` measures ops on this machine instead of the roofline; ``memory_limit_bytes``
    is the memory per device, of which ``cluster.memory_reserve`` stays unused (see ``search``)."""
    return search(
        model,
        cluster,
        example_inputs,
        mesh_shape=mesh_shape,
        memory_limit_bytes=memory_limit_bytes,
        time_limit_s=time_limit_s,
        axis_roles=axis_roles,
        optimizer=optimizer,
        progress=progress,
        dump_dir=dump_dir,
        profile=profile,
        outputs=outputs,
    ).plan


def reprice(
    model: torch.nn.Module,
    cluster: ClusterSpec,
    example_inputs,
    plan: Plan | str | os.PathLike,
    *,
    optimizer: Optimizer = Optimizer.ADAM,
    profile: bool | OpProfiler = False,
) -> Plan:
    """The plan's decisions, unchanged, priced on ``cluster``: no search. For a plan searched for
    one cluster (or one calibration) and run on another, or a plan chosen by other means, whose
    predicted step and memory are wanted where it runs. ``optimizer``: the one the run uses (a plan
    does not record it); ``profile``: as for ``search``. The result's solver status is
    "Repriced"; its objective, the cost tables' total on ``cluster``."""
    if isinstance(plan, (str, os.PathLike)):
        plan = Plan.load(plan)
    tg = trace(model, example_inputs)
    plan.check_matches(tg.fingerprint(), cluster.world_size)
    infos = analyze(tg)
    mesh = tuple(plan.mesh_shape)
    outputs = Outputs(plan.outputs)
    strats = build_strategies(tg, infos, mesh)
    profiler = resolve_profiler(profile, cluster, None)
    tables = build_costs(tg, infos, strats, cluster, mesh, optimizer, profiler=profiler, outputs=outputs)
    wanted = choice_from_plan(tg, plan)
    picks = {v: ss.index(wanted[v]) for v, ss in tables.strategies.items()}
    t = objective_s(tables, picks)
    sol = Solution(picks, t, "Repriced", 0.0, plan.solver.name, 0, 0)
    choice = _expanded_choice(tg, tables, sol)
    gs = _grad_sync_cost(tg, infos, tables, sol, choice, cluster, mesh, outputs)
    return _make_plan(
        tg, infos, tables, sol, choice, cluster, mesh, optimizer, plan.solver.candidates, 0.0, gs, outputs
    )


def autoparallelize(
    model: torch.nn.Module,
    cluster: ClusterSpec | None,
    example_inputs,
    *,
    plan: Plan | str | os.PathLike | None = None,
    **search_kwargs,
):
    """Call on every rank inside an initialized process group; returns the rank-local module.

    Every rank must pass the same model (same weights) and, at run time, the same full global
    batch: the module slices its own part. Gradients and optimizer steps are ordinary PyTorch.
    """
    from autopar.codegen.build import build_parallel_module

    if not dist.is_available() or not dist.is_initialized():
        raise DistributedSetupError(
            "autoparallelize needs an initialized process group: launch with torchrun and call "
            "torch.distributed.init_process_group(...) first (use autopar.plan(...) for offline planning)"
        )
    world = dist.get_world_size()
    if cluster is None:
        cluster = ClusterSpec.local()
    if cluster.world_size != world:
        raise DistributedSetupError(
            f"the cluster spec describes {cluster.world_size} devices but the process group has {world}; "
            f"pass a spec of {world} devices (e.g. ClusterSpec.local())"
        )
    if isinstance(plan, (str, os.PathLike)):
        plan = Plan.load(plan)
    if plan is None:
        result = search(model, cluster, example_inputs, **search_kwargs)
        tg, the_plan = result.traced, result.plan
    else:
        tg = trace(model, example_inputs)
        plan.check_matches(tg.fingerprint(), world)
        the_plan = plan
    choice = choice_from_plan(tg, the_plan)
    return build_parallel_module(model, tg, the_plan, choice, normalize_inputs(example_inputs))


def choice_from_plan(tg: TracedGraph, plan: Plan) -> dict[str, Strategy]:
    """Read every node's strategy back from the plan, refusing any the rules would not allow."""
    infos = analyze(tg)
    allowed = build_strategies(tg, infos, plan.mesh_shape)
    choice = {}
    for d in plan.decisions:
        s = Strategy(spec_from_str(d.output), tuple(spec_from_str(x) for x in d.inputs))
        if d.name in allowed and s not in allowed[d.name].strategies:
            raise PlanFormatError(
                f"node {d.name} ({d.op}): placement out={d.output} in={list(d.inputs)} is not a valid strategy on "
                f"mesh {plan.mesh_shape}; re-plan instead of editing the plan by hand"
            )
        choice[d.name] = s
    missing = [
        n.name for n in tg.graph.nodes if n.op in ("placeholder", "call_function") and n.name not in choice
    ]
    if missing:
        raise PlanFormatError(f"the plan has no decision for nodes {missing[:5]}; re-plan for this model")
    return choice
