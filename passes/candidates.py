"""The outer search's candidates: the meshes (and axis roles) to try, SPMD and per pipeline stage
count, in the order they are tried.

* SPMD (``mesh_runs``): the given mesh, or every mesh of up to ``MAX_MESH_AXES`` axes
  (``passes/solver.py:mesh_candidates``), each free and with axis 0 data parallel, or with its
  outer axis pinned data parallel from ``DATA_OUTER_MIN_AXES`` axes on; a mesh whose axes permute
  an earlier one's on the same kinds of link is the same problem, solved once (``spmd_runs``);
* pipelines (``stage_runs``): per stage count (``passes/pipeline.py:stage_counts``), the cluster
  one stage sees and its stage meshes (``stage_mesh_runs``: tensor parallel inside a node, data
  parallel outside, as Megatron-LM lays them out).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

from autopar.cluster import ClusterSpec
from autopar.cost_model.comm import axis_link
from autopar.errors import NoPlanFitsError
from autopar.options import AxisRole, SearchOptions
from autopar.passes.pipeline import stage_cluster
from autopar.passes.solver import mesh_candidates
from autopar.trades import ZeroStage

# meshes of up to this many axes are searched when no mesh shape or axis roles are given
MAX_MESH_AXES = 3
# in that search, a mesh of this many axes or more has its outer axis (the slowest links, across
# nodes when the mesh spans nodes) data parallel: every node's placement on it is fixed to the
# data-parallel solution of that axis alone, so the strategy tables are those of the other axes.
# Free, the tables of a 3-axis mesh grow as (options per axis)^6 per edge. A mesh_shape passed
# explicitly is searched without this restriction.
DATA_OUTER_MIN_AXES = 3


@dataclass(frozen=True)
class MeshRun:
    """One candidate of the outer search: a mesh and its axis roles (None: free). ``data_outer``:
    its outer axis is pinned to the data-parallel solution of that axis alone
    (``DATA_OUTER_MIN_AXES``); ``data_first``: the search's own second try of a mesh of fewer axes
    with axis 0 data parallel. Either is skipped, like any candidate whose roles leave a tensor no
    placement (``passes/candidate_tables.py``)."""

    mesh: tuple[int, ...]
    roles: tuple[AxisRole, ...] | None
    data_outer: bool = False
    data_first: bool = False
    stages: int = 1  # pipeline stages: ``mesh`` is then one stage's mesh (passes/pipeline.py)

    @property
    def label(self) -> str:
        expert = bool(self.roles) and self.roles[0] is AxisRole.EXPERT
        text = (
            f"{self.mesh} (axis 0 expert parallel)"
            if expert
            else f"{self.mesh} (axis 0 data parallel, axis 1 expert parallel)"
            if self.beside_data
            else f"{self.mesh} (axis 0 data parallel)"
            if self.data_outer or self.data_first
            else f"{self.mesh}"
        )
        return f"{text} x {self.stages} pipeline stages" if self.stages > 1 else text

    @property
    def tag(self) -> str:
        """The candidate in dump file names: ``2x4``, ``2x4_data``, ``8_expert``, ``2x4_pp8``."""
        return (
            "x".join(map(str, self.mesh))
            + ("_data" if self.data_first else "")
            + ("_expert" if self.roles and self.roles[0] is AxisRole.EXPERT else "")
            + ("_data_expert" if self.beside_data else "")
            + (f"_pp{self.stages}" if self.stages > 1 else "")
        )

    @property
    def beside_data(self) -> bool:
        """Expert parallelism beside data parallelism: axis 0 data parallel, axis 1 expert parallel."""
        return bool(self.roles) and self.roles[:2] == (AxisRole.DATA, AxisRole.EXPERT)

    @property
    def data_axes(self) -> tuple[int, ...]:
        """The axes of more than one device that split the batch (data and expert axes): ZeRO shards
        over them what is whole there (the experts an expert axis splits are left out:
        ``codegen/zero.py``, ``passes/trades.py:data_size``)."""
        return tuple(a for a, r in enumerate(self.roles or ()) if r.splits_batch and self.mesh[a] > 1)


def mesh_runs(cluster: ClusterSpec, options: SearchOptions) -> Iterator[MeshRun]:
    """The outer search's candidates, in the order they are tried: the given mesh, or every mesh of
    up to ``MAX_MESH_AXES`` axes (as many as the roles when roles are given); without roles, each
    mesh of fewer than ``DATA_OUTER_MIN_AXES`` axes twice, free and with axis 0 data parallel (the
    ILP prices a weight's gradient all-reduce as a bucket share only on a data axis, so the free
    search overprices data parallelism; see passes/use_price.py:bucketed_axes), and larger ones with
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
        if len(mesh) < DATA_OUTER_MIN_AXES:
            yield MeshRun(mesh, data, data_first=True)
        yield MeshRun(mesh, None)


def mirror_key(cluster: ClusterSpec, run: MeshRun) -> tuple:
    """A mesh whose axes are another's, permuted, each on the same kind of link (and role), is the
    same problem: the same key."""
    links = [axis_link(cluster, run.mesh, a) for a in range(len(run.mesh))]
    return tuple(
        sorted(
            (n, link.bandwidth, link.latency, run.roles[a].value if run.roles else "")
            for a, (n, link) in enumerate(zip(run.mesh, links))
        )
    )


def spmd_runs(
    cluster: ClusterSpec, options: SearchOptions, experts: bool = False
) -> Iterator[tuple[MeshRun, tuple | None]]:
    """The SPMD candidates (``mesh_runs``; none where the options force pipeline stages), each with
    the mesh it permutes (``mirror_key``: the same problem, solved once) or None. ``experts``: the
    model has mixture-of-experts layers: each one-axis mesh is also tried as an expert axis."""
    if options.pipeline_stages is not None and options.pipeline_stages != 1:
        return
    mirrors: dict[tuple, tuple] = {}
    for run in _with_experts(mesh_runs(cluster, options), options, experts, beside_data=True):
        key = mirror_key(cluster, run)
        yield run, mirrors.get(key)
        mirrors.setdefault(key, run.mesh)


def _with_experts(
    runs, options: SearchOptions, experts: bool, beside_data: bool = False
) -> Iterator[MeshRun]:
    """``runs``, and before each whose first axis is data parallel, where the model has experts and
    no roles are forced, the same with that axis an expert axis (``AxisRole.EXPERT``: the batch
    split as on a data axis, every MoE layer's experts split over it by all-to-all) and its other
    roles as they were (``data_outer`` too: axis 0 pinned to the one-axis expert solution).
    ``beside_data`` (SPMD meshes): a two-axis mesh's is also tried with axis 0 data parallel and
    axis 1 expert parallel, the batch split on both (expert parallelism beside data parallelism:
    the experts whole over the outer axis, split over the inner one)."""
    for run in runs:
        roles = run.roles
        if experts and options.axis_roles is None and roles and roles[0] is AxisRole.DATA and run.mesh[0] > 1:
            # first: where splitting the experts pays, its plan prunes the data-parallel twin
            yield dataclasses.replace(run, roles=(AxisRole.EXPERT, *roles[1:]), data_first=False)
            if beside_data and len(run.mesh) == 2 and run.mesh[1] > 1 and run.data_first:
                yield dataclasses.replace(run, roles=(AxisRole.DATA, AxisRole.EXPERT), data_first=False)
        yield run


def stage_runs(
    cluster: ClusterSpec, options: SearchOptions, stages: int, experts: bool = False
) -> tuple[ClusterSpec | None, list[MeshRun], str]:
    """The cluster one of ``stages`` pipeline stages sees and its candidates (``stage_mesh_runs``;
    where the model has experts, each data-parallel one also with an expert axis beside its data
    axis: ``_beside_data``), or (None, [], why there are none)."""
    sub = stage_cluster(cluster, stages)
    if sub is None:
        return None, [], f"pipeline: {stages} stages would split a node's devices unevenly: skipped"
    if options.zero_stage is not None and options.zero_stage >= ZeroStage.GRADIENTS:
        why = f"ZeRO-{int(options.zero_stage)} does not run with pipeline stages"
        return None, [], f"pipeline: {stages} stages: {why}: skipped"
    runs = []
    for run in _with_experts(stage_mesh_runs(sub, options, stages), options, experts):
        beside = _beside_data(run, sub.devices_per_node) if experts and options.axis_roles is None else None
        runs += [beside, run] if beside is not None else [run]
    return sub, runs, ""


def _beside_data(run: MeshRun, devices_per_node: int) -> MeshRun | None:
    """A stage mesh ``(d,)`` or ``(d, t)`` whose axis 0 is data parallel (tensor parallel after it)
    as ``(d / e, e)`` or ``(d / e, e, t)``, roles data x expert (x tensor): expert parallelism
    beside data parallelism inside the stage, as Megatron-Bridge runs MoE models (EP beside DP in
    each pipeline stage), the batch split on both axes. One expert degree per stage mesh, to keep
    the search's candidates few: the largest ``e < d`` dividing ``d`` whose expert and tensor axes
    fit in a node together (the all-to-all on the node's links). None where no such ``e`` exists."""
    if not run.roles or run.roles[0] is not AxisRole.DATA:
        return None
    d, rest = run.mesh[0], run.mesh[1:]
    inner = math.prod(rest)
    es = [e for e in range(2, d) if d % e == 0 and e * inner <= devices_per_node]
    if not es:
        return None
    mesh = (d // max(es), max(es), *rest)
    return dataclasses.replace(
        run,
        mesh=mesh,
        roles=(AxisRole.DATA, AxisRole.EXPERT, *run.roles[1:]),
        data_outer=len(mesh) >= DATA_OUTER_MIN_AXES,
        data_first=False,
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
