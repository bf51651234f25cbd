"""Cost tables: for every node strategy its seconds and bytes, for every edge a resharding matrix.

* node cost ``c[v, s]`` (s): compute of ``v`` under strategy ``s`` (``cost_model.compute``, or the
  time ``cost_model.profiler`` measured for its local shapes on one uncontended rank when a
  profiler is given; either times ``ClusterSpec.compute_slowdown`` when CPU ranks share too few
  cores) plus
  collectives inside a lowering (the all-reduces of a batch-sharded mean cross-entropy);
* node memory ``m[v, s]`` (B per device): parameters (+ gradient + optimizer states) for parameter
  placeholders, buffers and inputs; for activations, what autograd keeps until backward: the
  output when the op or a consumer saves it (``kept_for_backward``; a saved view keeps its base:
  ``NodeInfo.view_of``, an output that shares an input's storage),
  plus tensors the op saves internally; each divided by the number of pieces its placement cuts
  it into. Their sum is the memory live when backward starts;
* node transient ``p[v, s]`` (B per device): what ``v``'s backward holds while it runs, the
  gradient of its output and the gradients of its inputs (a replicated weight's whole gradient
  under data parallelism, a shard under tensor parallelism). The peak of a step is the memory
  above plus the largest transient of the chosen strategies (``solver``: a max, linearized);
* edge cost ``c[e, s_u, s_v]`` (s): resharding the tensor on edge ``e = (u -> v, input i)`` from
  ``u``'s output placement to what ``v`` requires under ``s_v``, forward and backward, plus the
  backward all-reduce of the Megatron "f" on the Replicate inputs of a split op
  (``cost_model.comm.CommModel.reshard``); ``inf`` marks a pair the axis roles forbid; edge memory ``m[e, s_u, s_v]``: the resharded copy when
  it is saved for backward.

``getitem`` nodes take their producer's placement; their edges are attached to the producer.
"""

from __future__ import annotations

import enum
import functools
import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from autopar.cluster import ClusterSpec
from autopar.cost_model.comm import Collective, CommModel
from autopar.cost_model.compute import node_time, optimizer_step_time
from autopar.passes.analyze import NodeInfo
from autopar.passes.coarsen import Classes
from autopar.passes.rules import tensor_inputs
from autopar.passes.strategies import AxisRole, NodeStrategies, Strategy
from autopar.passes.trace import Role, TracedGraph
from autopar.placement import is_replicate, replicated, volume_factor

if TYPE_CHECKING:
    from autopar.cost_model.profiler import OpProfiler

aten = torch.ops.aten


class Optimizer(enum.Enum):
    """Optimizer state kept per parameter element, in copies of the parameter."""

    SGD = 0
    SGD_MOMENTUM = 1
    ADAM = 2


@dataclass
class Edge:
    src: str  # variable-carrying node (getitem resolved to its producer)
    dst: str  # consumer ("output" for the graph outputs)
    cost: list[list[float]]  # [s_src][s_dst] seconds
    mem: list[list[float]]  # [s_src][s_dst] bytes
    colls: list[list[tuple[str, ...]]]  # collectives run, for the plan
    count: int = 1  # how many graph edges this one stands for (repeated blocks)

    def scaled(self, k: int) -> Edge:
        if k == 1:
            return self
        return Edge(
            self.src,
            self.dst,
            [[c * k for c in row] for row in self.cost],
            [[m * k for m in row] for row in self.mem],
            self.colls,
            self.count * k,
        )


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
    profiler: OpProfiler | None = None,
) -> CostTables:
    """Cost tables over class representatives (every node its own class when ``classes`` is None):
    node costs are multiplied by the class size, edges between the same two classes are priced once
    and multiplied by how many there are; an edge inside one class is a self-loop (same strategy).
    With a ``profiler``, an op's compute is its measured time on the local shapes where it has one."""
    comm = CommModel(cluster, mesh_shape)
    device = cluster.device
    slow = cluster.compute_slowdown  # CPU ranks sharing too few cores
    classes = classes or Classes.identity(list(strats))
    kept = kept_for_backward(tg, infos)
    tables = CostTables(mesh_shape, {k: v.strategies for k, v in strats.items()}, {}, {}, classes=classes)
    for name, ns in strats.items():
        info = infos[name]
        n = classes.count(name)
        costs, mems, peaks = [], [], []
        for s in ns.strategies:
            vol = volume_factor(s.out, mesh_shape)
            if info.role is Role.PARAM:
                copies = 1 + (1 + optimizer.value if info.requires_grad else 0)
                step = (
                    optimizer_step_time(info.out_bytes / vol, optimizer.value, device) * slow
                    if info.requires_grad
                    else 0.0
                )
                costs.append(n * step)
                mems.append(n * info.out_bytes * copies / vol)
                continue
            if info.role in (Role.BUFFER, Role.INPUT):
                costs.append(0.0)
                mems.append(n * info.out_bytes / vol)
                continue
            k = 1
            for a, split in enumerate(s.split_axes()):
                if split:
                    k *= mesh_shape[a]
            t = profiler.node_time(ns.node, s, mesh_shape, infos) if profiler is not None else None
            if t is None:
                t = node_time(info.flops, info.bytes, info.dtype, device, k, info.requires_grad)
            t *= slow
            t += _lowering_comm(ns.node, s, comm)
            costs.append(n * t)
            # internal saved tensors are cut like the op's work: by its largest split (e.g. a loss's
            # log-probabilities follow the logits, not the scalar output)
            work_vol = max([vol] + [volume_factor(x, mesh_shape) for x in s.ins])
            saved = (info.out_bytes if name in kept else 0) / vol + info.saved_temp_bytes / work_vol
            mems.append(n * saved)
            if info.requires_grad:
                grads = info.out_bytes / vol + sum(
                    infos[a.name].out_bytes / volume_factor(x, mesh_shape)
                    for a, x in zip(ns.inputs, s.ins)
                    if infos[a.name].requires_grad
                )
                peaks.append(grads)
        tables.node_cost[name] = costs
        tables.node_mem[name] = mems
        if len(peaks) == len(costs):
            tables.node_peak[name] = peaks
    if profiler is not None:
        profiler.flush()

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
            key = (classes.rep[src], rep, i, info.out_bytes, info.requires_grad)
            groups.setdefault(key, [inp, 0])[1] += 1
    for (src, dst, i, _, _), (inp, count) in groups.items():
        pinned = _pinned_axes(infos[src], axis_roles)
        tables.edges.append(_edge(src, dst, i, inp, infos, strats, comm, pinned).scaled(count))

    out_node = next(n for n in tg.graph.nodes if n.op == "output")
    r = replicated(len(mesh_shape))
    for inp in out_node.all_input_nodes:
        if not isinstance(inp.meta.get("val"), torch.Tensor):
            continue
        src = classes.rep[resolve_source(inp).name]
        nbytes = infos[inp.name].out_bytes
        row_c, row_m, row_n = [], [], []
        for su in strats[src].strategies:
            c, names = comm.reshard(su.out, r, nbytes, False)
            row_c.append([c])
            row_m.append([0.0])
            row_n.append([tuple(names)])
        tables.edges.append(Edge(src, "output", row_c, row_m, row_n))
    return tables


def _base(node: fx.Node, infos: dict[str, NodeInfo]) -> fx.Node:
    """The node that owns the storage a view (or getitem, or an op returning its input) refers to."""
    while node.op == "call_function":
        if node.target is operator.getitem:
            node = node.args[0]
        elif infos.get(node.name) is not None and infos[node.name].view_of:
            view_of = infos[node.name].view_of
            node = next(a for a in node.all_input_nodes if a.name == view_of)
        else:
            break
    return node


def kept_for_backward(tg: TracedGraph, infos: dict[str, NodeInfo]) -> set[str]:
    """Nodes whose output storage autograd keeps until backward: an op saves it as an input or as
    its own output (analyze.NodeInfo.saves_*); a saved view keeps its base."""
    kept: set[str] = set()
    for node in tg.graph.nodes:
        info = infos.get(node.name)
        if node.op != "call_function" or info is None or not info.requires_grad:
            continue
        if info.saves_output:
            kept.add(_base(node, infos).name)
        for inp, saved in zip(tensor_inputs(node), info.saves_inputs):
            if saved:
                kept.add(_base(inp, infos).name)
    return kept


@functools.cache
def f_axes(s: Strategy, i: int) -> tuple[int, ...]:
    """Axes on which input ``i`` is Replicate while the op is split: Megatron "f" goes there."""
    return tuple(a for a, split in enumerate(s.split_axes()) if split and is_replicate(s.ins[i][a]))


def _pinned_axes(info: NodeInfo, axis_roles) -> list[int]:
    """Tensor-parallel axes: there a weight (2+ dims) is used where it is stored (never gathered)."""
    if info.role is not Role.PARAM or not axis_roles or len(info.shape) < 2:
        return []
    return [a for a, r in enumerate(axis_roles) if r is AxisRole.TENSOR]


def _edge(src, dst, i, inp, infos, strats, comm: CommModel, pinned=()) -> Edge:
    info = infos[inp.name]
    nbytes = info.out_bytes
    rg = info.requires_grad
    saves = infos[dst].saves_inputs
    keeps = infos[dst].requires_grad and (saves[i] if i < len(saves) else True)
    # strategies share output placements and input requirements: price each distinct pair once
    have_ix: dict = {}
    rows = [have_ix.setdefault(su.out, len(have_ix)) for su in strats[src].strategies]
    need_ix: dict = {}
    cols = [need_ix.setdefault((sv.ins[i], f_axes(sv, i)), len(need_ix)) for sv in strats[dst].strategies]
    row_c, row_m, row_n = [], [], []
    for have in have_ix:
        rc, rm, rn = [], [], []
        for need, f in need_ix:
            c, names = comm.reshard(have, need, nbytes, rg, f)
            if any(have[a] != need[a] for a in pinned):
                c = math.inf  # forbidden pair (see _pinned_axes)
            rc.append(c)
            # the resharded copy lives until backward only if the consumer keeps this input
            rm.append(nbytes / volume_factor(need, comm.mesh_shape) if (keeps and need != have) else 0.0)
            rn.append(tuple(names))
        row_c.append([rc[j] for j in cols])
        row_m.append([rm[j] for j in cols])
        row_n.append([rn[j] for j in cols])
    cost = [list(row_c[r]) for r in rows]
    mem = [list(row_m[r]) for r in rows]
    colls = [row_n[r] for r in rows]
    return Edge(src, dst, cost, mem, colls)


def _lowering_comm(node: fx.Node, s: Strategy, comm: CommModel) -> float:
    """Collectives that a lowering runs inside the op (see codegen/lower.py)."""
    if node.target is aten.cross_entropy_loss.default and all(is_replicate(p) for p in s.out):
        # a mean over a split batch: all-reduce of the local loss sum and of the local token count on
        # every split axis, exactly as codegen/lower.py emits them (a sum or 'none' needs none)
        return sum(
            2 * comm.time(Collective.ALL_REDUCE, 4, a)
            for a, split in enumerate(s.split_axes())
            if split and comm.mesh_shape[a] > 1
        )
    return 0.0
