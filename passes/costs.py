"""Cost tables: for every node strategy its seconds and bytes, for every edge a resharding matrix.

* node cost ``c[v, s]`` (s): compute of ``v`` under strategy ``s`` (``cost_model.compute``, or the
  time ``autopar.tools.profiler`` measured for its local shapes on one uncontended rank when a
  profiler is given; either times ``ClusterSpec.compute_slowdown`` when CPU ranks share too few
  cores) plus the sum backward makes of its output's gradients when several ops use it
  (``cost_model.compute.accumulate_time``; for a parameter, with its optimizer step) plus
  the collectives its lowering issues inside the op, exactly the calls its registered description
  lists (``autopar/lowerings``: e.g. the all-reduces of a batch-sharded mean cross-entropy, a
  ring's hops less what they hide), and the bytes that lowering keeps for backward (in ``m``);
* node memory ``m[v, s]`` (B per device): parameters (+ optimizer states) for parameter
  placeholders, buffers and inputs; for activations, what autograd keeps until backward and the
  edges do not pay for (``Kept``): the output when the op itself saves it, plus tensors the op
  saves internally; each divided by the number of pieces its placement cuts it into;
* gradient ``CostTables.grad_mem[v][s]`` (B per device) of a parameter that needs one: backward
  allocates it (``optimizer.zero_grad()`` sets gradients to None, PyTorch's default) when it
  reaches the parameter's last use, and it lives to the end of the step: so it is live at the
  positions up to that use (``CostTables.grad_free``: just after it), and not in forward;
* node transient ``p[v, s]`` (B per device): what ``v``'s backward holds while it runs, read off
  its backward on meta tensors (``analyze``): the gradient of its output, the gradients of its
  inputs that are new tensors (a replicated weight's whole gradient under data parallelism, a
  shard under tensor parallelism; none for ``add``, which passes its gradient on) and the other
  tensors it holds at once (``NodeInfo.grad_temp_bytes``, cut like its work). The peak of a step
  adds to the bytes kept where a transient happens the largest transient there, a node's or an
  edge's (liveness by graph position: ``passes/memory_row.py``);
* edge cost ``c[e, s_u, s_v]`` (s): resharding the tensor on edge ``e = (u -> v, input i)`` from
  ``u``'s output placement to what ``v`` requires under ``s_v``, forward and backward, plus the
  backward all-reduce of the Megatron "f" on the Replicate inputs of a split op
  (``cost_model.comm.CommModel.reshard``), less what a collective matmul hides of it where the
  pair fuses a linear with the all-gather before it or the reduce-scatter after it
  (``overlap_matmuls``; ``passes/collective_matmul.py``, ``overlap_price``); ``inf`` marks a
  pair the axis roles forbid;
* edge memory ``m[e, s_u, s_v]`` (B per device): what ``v`` keeps until backward by taking the
  tensor: the resharded copy when it saves it (``nbytes / pieces(s_v's input placement)``), or,
  when no collective runs, the producer's storage if ``v`` is its only keeper
  (``nbytes(base) / pieces(s_u)``); a storage several consumers keep as it is counts once, the
  largest of their ``Edge.keep`` terms (``passes/memory_row.py``). The graph's outputs are kept
  too: the caller holds them through backward. Which storage is kept, and by whom: ``Kept``;
* edge transient ``Edge.peak[s_u][s_v]`` (B per device): the most the reshard's collectives hold
  at once, forward or backward, as ``codegen/collectives.py`` allocates
  (``cost_model.memory.reshard_transient``).

``getitem`` nodes take their producer's placement; their edges are attached to the producer.

What one use of a tensor costs and may take is ``passes/use_price.py``; which storages are kept
for backward, and who pays for them, ``passes/kept.py``. This module builds the tables from both.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.fx as fx

from autopar.cluster import ClusterSpec, DeviceSpec
from autopar.cost_model.comm import CommModel
from autopar.cost_model.compute import (
    accumulate_time,
    node_time,
    optimizer_step_bytes,
    optimizer_step_time,
)
from autopar.cost_model.memory import reshard_transient
from autopar.lowerings import describe
from autopar.lowerings.matmul_nd import is_grid
from autopar.options import Optimizer
from autopar.passes.analyze import NodeInfo
from autopar.passes.background import checkpoint
from autopar.passes.coarsen import Classes
from autopar.passes.collective_matmul import LINEAR, fused_steps, overlap_saving_s, sole_use
from autopar.passes.float8_price import Float8Offer, float8_choice
from autopar.passes.kept import kept_for_backward, kept_owner, use_kept_bytes
from autopar.passes.op_price import local_gemm_min_dim, node_elements, priced_calls, run_ratio
from autopar.passes.rules import tensor_inputs
from autopar.passes.strategies import AxisRole, NodeStrategies, Strategy, mutated_views, takes_as_stored
from autopar.passes.trace import Role, TracedGraph
from autopar.passes.use_price import (
    bucket_fixed_s,
    data_parallel_pair,
    deferred_output,
    f_axes,
    indexes_whole,
    pinned_axes,
    takes_whole,
    trainable_bytes,
    use_price,
)
from autopar.placement import (
    Outputs,
    is_replicate,
    output_placement,
    volume_factor,
)
from autopar.reshard import reshard_plan
from autopar.trades import Float8


class NodeTimer(Protocol):
    """What prices an op by measuring it (``autopar.tools.profiler.OpProfiler``): seconds of
    ``node``'s forward and backward on its local shapes under ``s``, None where it has no figure."""

    def node_time(self, node: fx.Node, s: Strategy, mesh_shape: Sequence[int], infos) -> float | None: ...

    def flush(self) -> None: ...

    def take_stats(self): ...


aten = torch.ops.aten


@dataclass
class Edge:
    src: str  # variable-carrying node (getitem resolved to its producer)
    dst: str  # consumer ("output" for the graph outputs)
    cost: list[list[float]]  # [s_src][s_dst] seconds
    mem: list[list[float]]  # [s_src][s_dst] bytes
    count: int = 1  # how many graph edges this one stands for (repeated blocks)
    # bytes that count once however many edges have them (maxima, not sums; per graph edge, not
    # scaled by ``count``): the largest transient of the reshard's collectives, and the storage of
    # ``owner`` (a node several consumers keep) when this consumer keeps it as it is
    peak: list[list[float]] | None = None
    keep: list[list[float]] | None = None
    owner: str = ""
    # the tensor carried (the consumer's input node), and per source strategy the placement it
    # has, per destination strategy the placement and "f" axes it is taken in: edges of one
    # tensor whose pairs have the same (have, need) run one reshard (passes/grad_sync.py)
    # (for the graph output, ``need`` is per source strategy: the placement it is returned in)
    tensor: str = ""
    have: list | None = None
    need: list | None = None
    # [s_src][s_dst] bytes of ``mem`` that are the resharded copy the consumer keeps: edges of one
    # tensor that take the same reshard keep one copy (``memory_row.peak_bytes``)
    copy: list[list[float]] | None = None
    # [s_src][s_dst] mesh axes where the pair defers a parameter's pure "f" to a gradient bucket
    # (``use_price``): the ILP pays one bucket's fixed price per such axis (``CostTables.bucket_fixed``)
    bucketed: list[list[tuple[int, ...]]] | None = None

    def scaled(self, k: int) -> Edge:
        if k == 1:
            return self
        cost = [[c * k for c in row] for row in self.cost]
        mem = [[m * k for m in row] for row in self.mem]
        copy = None if self.copy is None else [[m * k for m in row] for row in self.copy]
        return dataclasses.replace(self, cost=cost, mem=mem, copy=copy, count=self.count * k)

    def share_key(self, a: int, b: int) -> tuple | None:
        """What pair (a, b) reshards, for sharing it with the tensor's other edges; None: nothing."""
        if not self.tensor or self.have is None or self.need is None:
            return None
        have, (need, f) = self.have[a], self.need[a if self.dst == "output" else b]
        return None if have == need and not f else (have, need, f)

    def rows(self, src: str, pick: list[int]) -> Edge:
        """This edge from ``src``, whose strategy a stands for this edge's source strategy pick[a]."""

        def sel(t):
            return None if t is None else [t[b] for b in pick]

        return dataclasses.replace(
            self, src=src, cost=sel(self.cost), mem=sel(self.mem),
            peak=sel(self.peak), keep=sel(self.keep), have=sel(self.have), copy=sel(self.copy),
            bucketed=sel(self.bucketed),
            need=sel(self.need) if self.dst == "output" else self.need,
        )  # fmt: skip


@dataclass
class CostTables:
    mesh_shape: tuple[int, ...]
    strategies: dict[str, list[Strategy]]
    node_cost: dict[str, list[float]]
    node_mem: dict[str, list[float]]
    edges: list[Edge] = field(default_factory=list)
    classes: Classes | None = None
    # bytes a node's backward holds only while it runs (its output's gradient and its inputs'
    # gradients, local pieces): the plan's peak adds the largest of these, not their sum
    node_peak: dict[str, list[float]] = field(default_factory=dict)
    # node -> owner -> bytes per strategy of the owner's storage kept through that node (edges
    # folded into it, see Edge.keep): the owner counts once, the largest, times its class size
    node_keep: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # node -> positions (graph order) of its class's members: where its bytes are charged
    positions: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # node -> position -> transients folded into it from elsewhere (``memory_row.Folds``)
    peak_at: dict[str, dict[float, list[float]]] = field(default_factory=dict)
    # owner (class representative) -> positions of its members that several consumers keep
    keep_positions: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # folded tables: node -> positions -> bytes per strategy charged there (``memory_row.Folds``);
    # their node_mem is then only the sum
    mem_at: dict[str, dict[tuple[float, ...], list[float]]] = field(default_factory=dict)
    # parameter -> per strategy: its gradient's bytes (class total); live from the start of the step's
    # backward pass at the positions up to its members' last uses (``grad_free``: just after each)
    grad_mem: dict[str, list[float]] = field(default_factory=dict)
    grad_free: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # data-parallel mesh axis -> seconds a plan pays once if any pair defers a parameter's "f"
    # there (its gradient bucket's latency, ``bucket_fixed_s``); the pairs pay their shares
    # (``use_price``). Other axes price each "f" inline.
    bucket_fixed: dict[int, float] = field(default_factory=dict)
    # parameter -> per strategy: bytes of the temporaries its optimizer step holds while it runs
    # (``compute.optimizer_step_bytes``, one tensor of the class at a time); the steps run after
    # backward, at ``step_position`` (the last placeholder's: every parameter, state, gradient and
    # held output is charged by then, and no activation is kept past backward)
    step_peak: dict[str, list[float]] = field(default_factory=dict)
    step_position: float = 0.0
    # node -> per strategy: seconds of one member's collectives inside its lowering (in node_cost),
    # for every node whose lowering runs any
    node_inside: dict[str, list[float]] = field(default_factory=dict)
    # collective matmuls (``passes/collective_matmul.py``): priced on the edges where they fuse,
    # when on; each linear's compute per strategy (one member's, forward + backward, per rank), what
    # they hide the collectives behind
    overlap_matmuls: bool = False
    matmul_s: dict[str, list[float]] = field(default_factory=dict)
    # linear -> per strategy: the FP8 recipe its cost prices (None: its own precision), where the
    # tables offer FP8 (``Float8Offer``); the plan records the chosen strategy's
    float8: dict[str, list[Float8 | None]] = field(default_factory=dict)


def _memo(memos: dict | None, key: tuple, make):
    """``memos[key]``, made by ``make()`` where absent (every time where ``memos`` is None). Keys
    that name the graph and infos by ``id`` are safe while ``memos`` lives no longer than they
    do (``passes/search_problem.py:Problem`` holds all three)."""
    if memos is None:
        return make()
    got = memos.get(key)
    if got is None:
        got = memos[key] = make()
    return got


class PairMemo:
    """The edge pairs priced on one cluster, mesh and data axes (``_edge``), shared by the edges and
    candidates that price them. A pair is found by two small integers, its source placement's and
    its (destination placement, "f" axes)' ids, under the edge's ``alike`` key: hashing a
    placement is a Python call per ``Shard``, once per distinct placement of an edge here rather
    than once per pair (DeepSeek-V3's data x expert tables look up 40,000 pairs a candidate)."""

    def __init__(self) -> None:
        self.have_ids: dict = {}
        self.need_ids: dict = {}
        self.by_alike: dict[tuple, dict[int, tuple]] = {}

    def __len__(self) -> int:
        return sum(len(t) for t in self.by_alike.values())


@dataclass(frozen=True)
class GraphLayout:
    """What ``build_costs`` reads of the graph and its classes alone, whatever the mesh: graph
    positions, last uses, the edge groups (``build_costs``) with whether each is a written chain's
    link. Built once per (graph, infos, classes) where the caller keeps ``memos``."""

    classes: Classes  # held: the memo's key names it by ``id``
    order: dict[str, int]
    positions: dict[str, tuple[int, ...]]  # every class representative's members' positions
    step_position: int
    last_use: dict[str, int]
    keep_positions: dict[str, tuple[int, ...]]
    # (source class, destination class, input index, bytes, requires grad, kept bytes, owner, cast)
    # -> (the input node, how many graph edges, a consumer, taken as stored)
    groups: dict[tuple, tuple[fx.Node, int, fx.Node, bool]]
    grad_total: float


def graph_layout(tg: TracedGraph, infos: dict[str, NodeInfo], classes: Classes, kept) -> GraphLayout:
    """``GraphLayout`` of ``tg`` under ``classes`` (``kept``: ``kept_for_backward(tg, infos)``)."""
    order = {n.name: i for i, n in enumerate(tg.graph.nodes)}
    positions = {r: tuple(sorted(order[m] for m in ms)) for r, ms in classes.members.items()}
    step_position = max((order[p.name] for p in tg.placeholders), default=0)
    last_use = {n.name: max((order[u.name] for u in n.users), default=order[n.name]) for n in tg.graph.nodes}
    keep_positions: dict[str, tuple[int, ...]] = {}
    for base in sorted(kept.shared, key=order.__getitem__):
        if kept.source.get(base, base) in classes.rep:
            rep = classes.rep[kept.source.get(base, base)]
            keep_positions[rep] = (*keep_positions.get(rep, ()), order[base])
    # group edges by (source class, destination class, input index, tensor): price each group once
    groups: dict[tuple, list] = {}
    nodes = {n.name: n for n in tg.graph.nodes}
    for name, rep in classes.rep.items():
        node = nodes[name]
        if node.op != "call_function":
            continue
        for i, inp in enumerate(tensor_inputs(node)):
            src = resolve_source(inp).name
            if src not in classes.rep:
                continue
            info = infos[inp.name]
            orig, owner = kept_owner(kept, (name, i), infos, classes)
            cast = kept.keeper.get((name, i)) in kept.cast_each
            if name in kept.kept_views and infos[name].view_of == inp.name:
                cast = None  # the view's copy is kept (Kept.kept_views); None: no GEMM casts it
            key = (classes.rep[src], rep, i, info.moved_bytes, info.requires_grad, orig, owner, cast)
            groups.setdefault(key, [inp, 0, node])[1] += 1
    mutated = mutated_views(tg)
    return GraphLayout(
        classes, order, positions, step_position, last_use, keep_positions,
        {k: (inp, count, user, takes_as_stored(user, inp, mutated)) for k, (inp, count, user) in groups.items()},
        trainable_bytes(tg, infos),
    )  # fmt: skip


def resolve_source(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    return node


def build_costs(
    tg: TracedGraph,
    infos: dict[str, NodeInfo],
    strats: dict[str, NodeStrategies],
    cluster: ClusterSpec,
    mesh_shape: tuple[int, ...],
    optimizer: Optimizer,
    axis_roles: tuple[AxisRole, ...] | None = None,
    classes: Classes | None = None,
    profiler: NodeTimer | None = None,
    outputs: Outputs = Outputs.FULL,
    overlap_matmuls: bool = False,
    float8: Float8Offer | None = None,
    memos: dict | None = None,
) -> CostTables:
    """Cost tables over class representatives (every node its own class when ``classes`` is None):
    node costs are multiplied by the class size, edges between the same two classes are priced once
    and multiplied by how many there are; an edge inside one class is a self-loop (same strategy).
    With a ``profiler``, an op's compute is its measured time on the local shapes where it has one.
    ``outputs``: the placement the module returns the graph's outputs in (whole, or as pieces).
    ``overlap_matmuls``: the edges where a linear and its collective fuse into a collective matmul
    are priced as it runs (``passes/collective_matmul.py``, ``overlap_price``). ``float8``: the
    linears that may run FP8, each strategy priced at the cheaper of its FP8 and its own precision
    (``float8_price``; ``CostTables.float8`` says which). ``memos``: what earlier tables of
    the same graph computed, taken and added to (``_memo``): the tensors kept for backward, the
    gradient uses, and the edge pairs priced, by cluster, mesh and data axes (a pair's price
    depends on those and its key in ``_edge`` alone)."""
    comm = CommModel(cluster, mesh_shape)
    device = cluster.device
    slow = cluster.compute_slowdown  # CPU ranks sharing too few cores
    given_classes = classes is not None and memos is not None
    classes = classes or Classes.identity(list(strats))
    kept = _memo(memos, ("kept", id(tg), id(infos)), lambda: kept_for_backward(tg, infos))
    tables = CostTables(mesh_shape, {k: v.strategies for k, v in strats.items()}, {}, {}, classes=classes)
    tables.overlap_matmuls = overlap_matmuls
    # the graph's layout under the classes, the same on every mesh: once per search (the memo holds
    # ``classes``, so its id names it while the memo lives; classes made here are never shared)
    layout = (
        _memo(
            memos, ("layout", id(tg), id(infos), id(classes)), lambda: graph_layout(tg, infos, classes, kept)
        )
        if given_classes
        else graph_layout(tg, infos, classes, kept)
    )
    order, last_use = layout.order, layout.last_use
    tables.positions = {r: layout.positions[r] for r in strats}
    tables.step_position = layout.step_position
    tables.keep_positions = dict(layout.keep_positions)
    uses = _memo(memos, ("uses", id(tg), id(infos)), lambda: grad_uses(tg, infos))
    for name, ns in strats.items():
        checkpoint()  # on a search's worker thread: only while the search waits (passes/background.py)
        info = infos[name]
        n = classes.count(name)
        members = classes.members[name]
        costs, mems, peaks, inside = [], [], [], []
        own_costs = []  # a linear's strategies in its own precision, where forced FP8 forbids them all
        has_inside = False
        if info.role is Role.PARAM and info.requires_grad:
            tables.grad_mem[name] = [
                n * info.out_bytes / volume_factor(s.out, mesh_shape) for s in ns.strategies
            ]
            tables.grad_free[name] = tuple(sorted(last_use[m] + 0.5 for m in classes.members[name]))
        for s in ns.strategies:
            vol = volume_factor(s.out, mesh_shape)
            # backward sums the gradients of an output several ops use (0 for buffers and inputs);
            # twins may differ in their uses (a block's last output feeds the final norm only)
            acc = sum(accumulate_time(info.out_bytes / vol, uses.get(m, 0), device) for m in members) * slow
            if info.role is Role.PARAM:
                if info.requires_grad:
                    temp = optimizer_step_bytes(info.out_bytes / vol, optimizer.name)
                    if temp:
                        tables.step_peak.setdefault(name, []).append(temp)
                copies = 1 + (optimizer.value if info.requires_grad else 0)
                step = (
                    optimizer_step_time(info.out_bytes / vol, optimizer.value, device, optimizer.name) * slow
                    if info.requires_grad
                    else 0.0
                )
                costs.append(n * step + acc)
                mems.append(n * info.out_bytes * copies / vol)
                continue
            if info.role in (Role.BUFFER, Role.INPUT):
                costs.append(0.0)
                mems.append(n * info.out_bytes / vol)
                continue
            k = s.work_divisor(mesh_shape)
            t = profiler.node_time(ns.node, s, mesh_shape, infos) if profiler is not None else None
            if t is None:
                t = analytical_node_time(info, ns.inputs, infos, device, k, s, mesh_shape)
            lowered = describe(ns.node, s, mesh_shape).in_dtype(run_ratio(ns.node, info))
            t *= slow * lowered.work
            if overlap_matmuls and ns.node.target is LINEAR:
                tables.matmul_s.setdefault(name, []).append(t)
            calls = priced_calls(lowered, comm, t)
            t_in = sum(sec for _, sec in calls)
            t += t_in
            own_costs.append((t, acc))
            if float8 is not None and ns.node.target is LINEAR and not calls:
                recipe, t8, t8_in = float8_choice(float8, name, info, ns, infos, device, k, s, comm, slow, t)
                tables.float8.setdefault(name, [None] * len(ns.strategies))[len(costs)] = recipe
                if recipe is None and float8.forced and float8.recipes_for(name, info.dtype):
                    # forced: a placement under which the linear cannot run FP8 (a Partial input,
                    # pieces off the 16-element alignment) is not taken where another can be
                    # (where none can, all keep their own cost: below)
                    t = math.inf
                elif recipe is not None:
                    t, t_in, calls = t8 + t8_in, t8_in, [None]
                    if overlap_matmuls:  # an FP8 linear runs no collective matmul (codegen/lower.py)
                        tables.matmul_s[name][-1] = 0.0
            inside.append(t_in)
            has_inside |= bool(calls)
            costs.append(n * t + acc)
            # internal saved tensors are cut like the op's work: by its largest split (e.g. a loss's
            # log-probabilities follow the logits, not the scalar output)
            work_vol = max([vol] + [volume_factor(x, mesh_shape) for x in s.ins])
            saved = kept.at_node_bytes(name, info) / vol + info.saved_temp_bytes / work_vol
            saved += lowered.saved_bytes  # what the op's lowering keeps beyond the traced op
            mems.append(n * saved)
            if info.requires_grad:  # its output's gradient, the new input gradients, internal temporaries
                new = info.grad_new or (True,) * len(s.ins)
                # a parameter's gradient made by its last use becomes its .grad: grad_mem counts it
                grads = info.out_bytes / vol + sum(
                    infos[a.name].out_bytes / volume_factor(x, mesh_shape)
                    for a, x, fresh in zip(ns.inputs, s.ins, new)
                    if infos[a.name].requires_grad
                    and fresh
                    and not (infos[a.name].role is Role.PARAM and last_use[a.name] == order[name])
                )
                peaks.append(grads + info.grad_temp_bytes / work_vol)
        if costs and all(math.isinf(c) for c in costs):  # none can run FP8: each in its own precision
            costs = [n * t_own + a for t_own, a in own_costs]
        tables.node_cost[name] = costs
        tables.node_mem[name] = mems
        if has_inside:  # recorded even where every hop hides: pricing reads it, never recomputes
            tables.node_inside[name] = inside
        if len(peaks) == len(costs):
            tables.node_peak[name] = peaks
    if profiler is not None:
        profiler.flush()

    grad_total = layout.grad_total
    data_axes = tuple(a for a, r in enumerate(axis_roles or ()) if r.splits_batch and mesh_shape[a] > 1)
    tables.bucket_fixed = {a: bucket_fixed_s(comm, a) for a in data_axes}
    matmul_s = tables.matmul_s if overlap_matmuls else None
    memo: PairMemo = _memo(memos, ("edges", cluster, tuple(mesh_shape), data_axes), PairMemo)
    for (src, dst, i, _, _, orig, owner, cast), (inp, count, user, stored) in layout.groups.items():
        checkpoint()
        pinned = pinned_axes(infos[src], axis_roles)
        if stored:  # a written chain's link (strategies.takes_as_stored): never moved (on any axis)
            pinned = list(range(len(mesh_shape)))
        e = _edge(
            src, dst, i, inp, infos, strats, comm, pinned, orig, owner, grad_total, data_axes, memo, cast
        )
        if matmul_s is not None:
            _fuse_matmuls(e, user, i, inp, infos, strats, comm, matmul_s)
        tables.edges.append(e.scaled(count))

    out_node = next(n for n in tg.graph.nodes if n.op == "output")
    for k, inp in enumerate(out_node.all_input_nodes):
        if not isinstance(inp.meta.get("val"), torch.Tensor):
            continue
        src = classes.rep[resolve_source(inp).name]
        nbytes = infos[inp.name].out_bytes
        orig, owner = kept_owner(kept, ("output", k), infos, classes)
        row_c, row_m, row_p, row_k, row_cp = [], [], [], [], []
        for su in strats[src].strategies:
            r = output_placement(su.out, outputs)
            c, calls = comm.reshard(su.out, r, nbytes, False)
            row_c.append([0.0 if deferred_output(calls) else c])  # a loss's sum: off the path
            # the caller holds the output through backward: a gathered copy, or the tensor itself
            copy, own = use_kept_bytes(su.out, r, nbytes, True, orig, mesh_shape)
            row_cp.append([copy])
            row_m.append([copy + (0.0 if owner else own)])
            row_k.append([own])
            row_p.append([reshard_transient(su.out, r, nbytes, mesh_shape, False, (), True)])
        tables.edges.append(
            Edge(
                src, "output", row_c, row_m, 1, row_p, row_k if owner else None, owner,
                tensor=inp.name, have=[su.out for su in strats[src].strategies],
                need=[(output_placement(su.out, outputs), ()) for su in strats[src].strategies], copy=row_cp,
            )
        )  # fmt: skip
    return tables


def grad_uses(tg: TracedGraph, infos: dict[str, NodeInfo]) -> dict[str, int]:
    """Node -> how many op inputs send its output a gradient: backward sums that many."""
    uses: dict[str, int] = {}
    for node in tg.graph.nodes:
        info = infos.get(node.name)
        if node.op != "call_function" or info is None or not info.requires_grad:
            continue
        for inp in tensor_inputs(node):
            if infos.get(inp.name) is not None and infos[inp.name].requires_grad:
                uses[inp.name] = uses.get(inp.name, 0) + 1
    return uses


def _fuse_matmuls(
    e: Edge, user: fx.Node, i: int, inp: fx.Node, infos, strats, comm: CommModel, matmul_s: dict
) -> None:
    """Take from ``e``'s costs what the collective matmuls of its pairs hide (``overlap_price``):
    a gather's against the consumer's compute under its strategy, a scatter's against the
    producer's. ``user``: the consumer (a member of ``e.dst``'s class), ``inp`` what it takes."""
    src = resolve_source(inp)
    if not (user.target is LINEAR and i == 0) and not (src.target is LINEAR and sole_use(src) == (user, i)):
        return
    info = infos[inp.name]
    state = infos[e.src].role in (Role.PARAM, Role.BUFFER)
    rg = info.requires_grad
    for a, su in enumerate(strats[e.src].strategies):
        for b, sv in enumerate(strats[e.dst].strategies):
            if not math.isfinite(e.cost[a][b]):
                continue

            def compute(linear: fx.Node, a=a, b=b) -> float:
                return matmul_s[e.dst][b] if linear is user else matmul_s[e.src][a]

            f = f_axes(sv, i)
            steps = reshard_plan(tuple(su.out), tuple(sv.ins[i]), comm.mesh_shape, info.moved_bytes, f).steps
            fused = fused_steps(user, i, inp, steps, sv.out, state, (is_grid(su), is_grid(sv)))
            if not fused:
                continue
            e.cost[a][b] -= overlap_saving_s(comm, fused, compute, rg)
            for fs in fused:  # a re-gather keeps the shard: 1/n of the gathered copy
                if fs.extra_calls(rg) and e.copy is not None:
                    cut = e.copy[a][b] * (1 - 1 / comm.mesh_shape[fs.step.axis])
                    e.copy[a] = [x - cut if j == b else x for j, x in enumerate(e.copy[a])]
                    e.mem[a] = [x - cut if j == b else x for j, x in enumerate(e.mem[a])]


def _edge(
    src, dst, i, inp, infos, strats, comm: CommModel, pinned=(), orig: int = 0, owner: str = "",
    grad_total: float = 0.0, data_axes: Sequence[int] = (), memo: PairMemo | None = None, cast_each: bool | None = False,
) -> Edge:  # fmt: skip
    """The edge of ``inp`` into input ``i`` of ``dst``: per (source, destination) strategy pair
    its seconds, kept bytes, transient, storage kept as it is, copy and bucketed axes. ``memo``:
    pairs priced by earlier edges (``comm`` and ``data_axes`` fixed: ``build_costs``'s ``memos``)."""
    memo = PairMemo() if memo is None else memo
    info = infos[inp.name]
    nbytes = info.moved_bytes  # in the half type where every use casts it so (passes/half_reshard.py)
    rg = info.requires_grad
    param = grad_total if infos[src].role is Role.PARAM else 0.0
    checked = () if takes_whole(strats[dst].node) or indexes_whole(strats[dst].node, i, info) else data_axes
    saves = infos[dst].saves_inputs
    keeps = infos[dst].requires_grad and (saves[i] if i < len(saves) else True)
    view = cast_each is None  # a view kept through (Kept.kept_views): a gathered input's copy is kept
    if view:
        keeps, cast_each = True, False
    # strategies share output placements and input requirements: price each distinct pair once
    have_ix: dict = {}
    rows = [have_ix.setdefault(su.out, len(have_ix)) for su in strats[src].strategies]
    need_ix: dict = {}
    cols = [need_ix.setdefault((sv.ins[i], f_axes(sv, i)), len(need_ix)) for sv in strats[dst].strategies]
    is_param = infos[src].role is Role.PARAM
    # what a pair costs depends on these and the placements alone: edges of one size share it
    # (three in four pairs of a Llama's tables are priced by an earlier edge)
    alike = (nbytes, rg, param, tuple(pinned), is_param, checked, keeps, orig, cast_each, view)
    priced = memo.by_alike.setdefault(alike, {})
    have_ids, need_ids = memo.have_ids, memo.need_ids
    needs = [(need, f, need_ids.setdefault((need, f), len(need_ids))) for need, f in need_ix]
    row_c, row_m, row_p, row_k, row_cp, row_b = [], [], [], [], [], []
    for have in have_ix:
        rc, rm, rp, rk, rcp, rb = [], [], [], [], [], []
        h = have_ids.setdefault(have, len(have_ids)) << 32  # a pair's key: h | its need's id (< 2**32)
        for need, f, n in needs:
            key = h | n
            hit = priced.get(key)
            if hit is None:
                c, bucketed = use_price(comm, have, need, nbytes, rg, f, param, data_axes)
                pinned_moves = any(have[a] != need[a] for a in pinned)
                if pinned_moves or not data_parallel_pair(have, need, is_param, checked):
                    c = math.inf  # forbidden pair (see pinned_axes, data_parallel_pair)
                copy, own = use_kept_bytes(have, need, nbytes, keeps, orig, comm.mesh_shape)
                if view and all(is_replicate(h) for h, w in zip(have, need) if h != w):
                    copy = 0.0  # a slice of a replicated tensor: a view of the storage kept anyway
                peak = reshard_transient(have, need, nbytes, comm.mesh_shape, rg, f, keeps)
                hit = priced[key] = (c, bucketed, copy, own, peak)
            c, bucketed, copy, own, peak = hit
            rb.append(bucketed)
            rc.append(c)
            # a GEMM that casts the storage itself (no collective, no "f" before it) keeps its own cast
            mine = own if cast_each and not f else 0.0
            own -= mine
            rm.append(copy + mine + (0.0 if owner else own))
            rcp.append(copy)
            rk.append(own)
            rp.append(peak)
        for row, r in (
            (row_c, rc), (row_m, rm), (row_p, rp), (row_k, rk), (row_cp, rcp), (row_b, rb)
        ):  # fmt: skip
            row.append([r[j] for j in cols])
    return Edge(
        src, dst, [list(row_c[r]) for r in rows], [list(row_m[r]) for r in rows], 1,
        [row_p[r] for r in rows], [row_k[r] for r in rows] if owner else None, owner,
        tensor=inp.name, have=[su.out for su in strats[src].strategies],
        need=[(sv.ins[i], f_axes(sv, i)) for sv in strats[dst].strategies], copy=[row_cp[r] for r in rows],
        bucketed=[row_b[r] for r in rows] if any(any(r) for r in row_b) else None,
    )  # fmt: skip


def analytical_node_time(
    info: NodeInfo,
    inputs: list[fx.Node],
    infos: dict[str, NodeInfo],
    device: DeviceSpec,
    k: int,
    s: Strategy | None = None,
    mesh_shape: Sequence[int] = (),
) -> float:
    """``cost_model.compute.node_time`` of one node whose work is divided ``k`` ways. Its backward
    makes a new gradient for each input that needs one and whose gradient is not passed on (an
    ``add`` passes its gradient on; a matmul makes two); every such input when the probe did not run.
    Per-element figures count the elements of the op's largest tensor (a loss's logits, not its
    scalar output). A matmul under strategy ``s`` is priced at its local GEMM's smallest size
    (``compute.gemm_min_dim``)."""
    fresh = info.grad_new or (True,) * len(inputs)
    new = [a for a, f in zip(inputs, fresh) if f and infos[a.name].requires_grad]
    # its output's gradient read and the new ones written; nothing where it passes the gradient on
    grad_bytes = info.out_bytes + sum(infos[a.name].out_bytes for a in new) if new else 0
    return node_time(
        info.flops, info.bytes, info.rate_dtype, device, k, info.requires_grad,
        new_grads=len(new), op=info.target, elements=node_elements(info, inputs), grad_bytes=grad_bytes,
        min_dim=local_gemm_min_dim(info.target, inputs, s, mesh_shape),
    )  # fmt: skip
