"""Plan replay: a plan's decisions read back onto the model's graph, without a search.

A plan (``autopar/plan.py``) names the graph it was made for by fingerprint and each node's
strategy by strings. Replaying it on the model and example inputs gives what the search had when it
chose the plan:

* ``traced_as_planned``: the model traced and rewritten as the search rewrote it (the outputs the
  plan does not return dropped, its fused kernels substituted at the same nodes);
* ``plan_regions``: where the plan runs a data-parallel region (``passes/data_region.py``), the data
  role on its axis and the region nodes' options, their local arguments stored for codegen;
* ``choice_from_plan``: every node's ``Strategy``, each one the rules allow on the plan's mesh
  (``check_choice``), so a plan edited by hand into something codegen cannot run is refused.

The search's own result carries the same graph and choice (rank 0 of ``autoparallelize`` builds
from it); the other ranks, a plan loaded from a file and ``autopar.reprice`` replay the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.tensor.placement_types import Replicate, Shard

from autopar.errors import PlanFormatError, PlanMismatchError
from autopar.options import AxisRole
from autopar.passes.analyze import NodeInfo, analyze
from autopar.passes.costs import CostTables
from autopar.passes.data_region import plan_region
from autopar.passes.experts import mark_nodes, mark_skew
from autopar.passes.fuse import fuse_as_planned
from autopar.passes.local_rows import trace_rows
from autopar.passes.rules import AxisOption
from autopar.passes.strategies import Nest, NodeStrategies, Strategy, build_strategies
from autopar.passes.trace import Role, TracedGraph, keep_loss_only, trace
from autopar.placement import (
    Outputs,
    is_shard,
    own_rows_axes,
    spec_from_str,
    spec_to_str,
    via_from_str,
    via_to_str,
)
from autopar.plan import Plan


@dataclass(frozen=True)
class PlanRegions:
    """A plan's data-parallel region as ``build_strategies`` offers it: the axis roles (the data
    role on the region's axis; empty where the plan runs no region) and the region nodes' options
    on that axis."""

    roles: tuple[AxisRole, ...] = ()
    options: dict[str, AxisOption] = field(default_factory=dict)


NO_REGIONS = PlanRegions()


def rewrite_as_planned(tg: TracedGraph, plan: Plan) -> None:
    """Rewrite a trace of the model as the plan's search rewrote its own: the outputs the plan does
    not return dropped (``Outputs.LOSS``), its fused kernels substituted at the same nodes, its
    MoE ops marked with the routing skew it was priced at."""
    if plan.outputs == Outputs.LOSS.value:
        keep_loss_only(tg)
    fuse_as_planned(tg, plan.kernels)
    mark_skew(tg, plan.expert_skew or 1.0)
    mark_nodes(tg, plan.cluster.get("devices_per_node"))


def traced_as_planned(model, example_inputs, plan: Plan) -> TracedGraph:
    """The model traced and rewritten as the plan's search rewrote it (``rewrite_as_planned``);
    PlanMismatchError first where the plan was made for another model or other inputs
    (``Plan.check_model``: a rewrite would fail on it with less to say)."""
    tg = trace(model, example_inputs)
    plan.check_model(tg.model_name, *placeholder_shapes(tg))
    rewrite_as_planned(tg, plan)
    return tg


def placeholder_shapes(tg: TracedGraph) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The traced parameters' and inputs' shapes by name (``Plan.check_model``)."""
    nodes = {n.name: n for n in tg.graph.nodes if n.op == "placeholder"}
    out: dict[Role, dict[str, tuple[int, ...]]] = {Role.PARAM: {}, Role.INPUT: {}}
    for p in tg.placeholders:
        if p.role in out:
            val = nodes[p.name].meta.get("val")
            out[p.role][p.target] = tuple(val.shape) if hasattr(val, "shape") else ()
    return out[Role.PARAM], out[Role.INPUT]


def plan_regions(model, tg: TracedGraph, plan: Plan, example_inputs) -> PlanRegions:
    """Where the plan runs a data-parallel region (``passes/data_region.py``: decisions via
    ``OwnRows``), the data role on its axis and the region nodes' options, read off the model traced
    again on one rank's rows of ``example_inputs`` (their local arguments stored in ``tg`` for
    codegen); ``NO_REGIONS`` where it runs none."""
    names = [d.name for d in plan.decisions if own_rows_axes(via_from_str(d.via))]
    if not names:
        return NO_REGIONS
    axes = {a for d in plan.decisions for a in own_rows_axes(via_from_str(d.via))}
    if len(axes) != 1:
        raise PlanFormatError(f"the plan runs data-parallel regions on mesh axes {sorted(axes)}; one at most")
    (axis,) = axes
    parts = plan.mesh_shape[axis]
    local = trace_rows(model, example_inputs, tg, parts, lambda other: rewrite_as_planned(other, plan))
    if not isinstance(local, str):
        local = plan_region(tg, local, names)
    if isinstance(local, str):
        raise PlanMismatchError(
            f"the plan's data-parallel region cannot run on one rank's rows: {local}; re-plan"
        )
    roles = tuple(AxisRole.DATA if a == axis else AxisRole.AUTO for a in range(len(plan.mesh_shape)))
    return PlanRegions(roles, local)


def plan_strategies(
    tg: TracedGraph, infos: dict[str, NodeInfo], plan: Plan, regions: PlanRegions = NO_REGIONS
) -> dict[str, NodeStrategies]:
    """Every node's strategies on the plan's mesh, its data-parallel region's included: what the
    rules allow the plan's decisions to be."""
    return build_strategies(
        tg, infos, plan.mesh_shape, regions.roles or None, regions=regions.options,
        nest=batch_nest(tg, decoded_choice(plan), plan.mesh_shape),
    )  # fmt: skip


def batch_nest(tg: TracedGraph, choice: dict[str, Strategy], mesh_shape) -> Nest:
    """The groups of axes a plan read back may split a dim on together (its axis roles are not
    recorded; ``passes/strategies.py:nest_axes`` reads them off the search's): the axes of more
    than one device on which the plan splits its inputs' batch (dim 0), where two or more do
    (expert parallelism beside data parallelism), and each set of axes one of its decisions splits
    one dim on (sequence parallelism inside context parallelism, the batch's own)."""
    axes = set()
    for p in tg.placeholders:
        s = choice.get(p.name)
        if p.role is Role.INPUT and s is not None:
            axes.update(a for a, x in enumerate(s.out) if x == Shard(0) and mesh_shape[a] > 1)
    groups = {tuple(sorted(axes))} if len(axes) > 1 else set()
    for s in choice.values():
        for spec in (s.out, *s.ins):
            held: dict[int, list[int]] = {}
            for a, x in enumerate(spec):
                if is_shard(x) and mesh_shape[a] > 1:
                    held.setdefault(x.dim, []).append(a)
            groups.update(tuple(g) for g in held.values() if len(g) > 1)
    return tuple(sorted(groups))


def decoded_choice(plan: Plan) -> dict[str, Strategy]:
    """The plan's decisions as strategies, by node name, unchecked (``choice_from_plan`` checks)."""
    return {
        d.name: Strategy(
            spec_from_str(d.output), tuple(spec_from_str(x) for x in d.inputs), via_from_str(d.via)
        )
        for d in plan.decisions
    }


def choice_from_plan(
    tg: TracedGraph,
    plan: Plan,
    regions: PlanRegions = NO_REGIONS,
    allowed: dict[str, NodeStrategies] | None = None,
) -> dict[str, Strategy]:
    """Read every node's strategy back from the plan, refusing any the rules would not allow
    (``check_choice``; ``regions``: ``plan_regions``' for a plan with a data-parallel region;
    ``allowed``: ``plan_strategies``' where the caller has them)."""
    choice = decoded_choice(plan)
    check_choice(tg, plan.mesh_shape, choice, regions, allowed)
    return choice


def table_indices(tables: CostTables, plan: Plan) -> dict[str, int]:
    """Each node's index in ``tables.strategies`` of the strategy ``plan`` decided for it (the
    first of equal ones; 0 for a node the plan does not name), to read the tables' prices and
    bytes under the plan; PlanMismatchError where a decision is not among the node's strategies."""
    choice = dict.fromkeys(tables.strategies, 0)
    for d in plan.decisions:
        if d.name not in tables.strategies:
            continue
        hits = [
            i
            for i, st in enumerate(tables.strategies[d.name])
            if (spec_to_str(st.out), tuple(spec_to_str(x) for x in st.ins), via_to_str(st.via))
            == (d.output, d.inputs, d.via)
        ]
        if not hits:
            raise PlanMismatchError(f"the plan's strategy of {d.name} is not in the tables")
        choice[d.name] = hits[0]
    return choice


def check_choice(
    tg: TracedGraph,
    mesh_shape,
    choice: dict[str, Strategy],
    regions: PlanRegions = NO_REGIONS,
    allowed: dict[str, NodeStrategies] | None = None,
) -> None:
    """Raise PlanFormatError unless every placeholder and op of ``tg`` has a strategy in ``choice``
    that the rules allow on ``mesh_shape`` (``allowed``, else built here). A placement on an axis of
    one device counts as Replicate: on a micro-batch of one row the rules offer only Replicate where
    the plan, made for the whole batch, says Shard(0)."""
    if allowed is None:
        allowed = build_strategies(
            tg, analyze(tg), mesh_shape, regions.roles or None, regions=regions.options,
            nest=batch_nest(tg, choice, mesh_shape),
        )  # fmt: skip
    single = [n == 1 for n in mesh_shape]

    def same_on_mesh(s: Strategy) -> tuple:
        def canon(spec):
            return tuple(Replicate() if one else p for p, one in zip(spec, single))

        return canon(s.out), tuple(canon(x) for x in s.ins), s.via

    nodes = {n.name: n for n in tg.graph.nodes}
    for name, s in choice.items():
        if (
            name in allowed
            and s not in allowed[name].strategies
            and same_on_mesh(s) not in {same_on_mesh(x) for x in allowed[name].strategies}
        ):
            node = nodes[name]
            op = "placeholder" if node.op == "placeholder" else str(node.target)
            raise PlanFormatError(
                f"node {name} ({op}): placement out={spec_to_str(s.out)} in={[spec_to_str(x) for x in s.ins]} "
                f"is not a valid strategy on mesh {tuple(mesh_shape)}; re-plan instead of editing the plan by hand"
            )
    missing = [
        n.name for n in tg.graph.nodes if n.op in ("placeholder", "call_function") and n.name not in choice
    ]
    if missing:
        raise PlanFormatError(f"the plan has no decision for nodes {missing[:5]}; re-plan for this model")


def in_graph_order(tg: TracedGraph, choice: dict[str, Strategy]) -> dict[str, Strategy]:
    """``choice`` ordered as ``tg``'s nodes (the order of a plan's decisions)."""
    return {n.name: choice[n.name] for n in tg.graph.nodes if n.name in choice}
