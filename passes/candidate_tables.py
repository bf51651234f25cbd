"""One candidate's strategies and cost tables: the ``strategies`` and ``cost`` stages of the search.

``prepare_candidate`` builds them for a candidate (``passes/candidates.py:MeshRun``): the axes it
pins (``pinned_axes``: a data-parallel outer axis fixed to the solution of that axis alone), every
node's strategies on its mesh (``strategies_stage``), their cost tables (``cost_stage``), or the
candidate skipped where its axis roles leave some tensor no placement. ``region_stage`` builds them
again with a data-parallel region (``passes/data_region.py``) where an op blocks the data role.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from autopar.cluster import ClusterSpec
from autopar.errors import NoPlanFitsError
from autopar.options import AxisRole, Optimizer
from autopar.passes.analyze import NodeInfo
from autopar.passes.candidates import MeshRun
from autopar.passes.coarsen import Classes
from autopar.passes.costs import CostTables, NodeTimer, build_costs
from autopar.passes.data_region import find_region, region_parts
from autopar.passes.dumps import Recorder, Stages, costs_tsv, strategies_tsv
from autopar.passes.float8_price import Float8Offer
from autopar.passes.fuse import fuse
from autopar.passes.local_rows import trace_rows
from autopar.passes.outcome import Entry, Verdict
from autopar.passes.search_problem import Problem
from autopar.passes.solver import solve
from autopar.passes.strategies import NodeStrategies, Strategy, build_strategies, whole_norms_on_tensor_axes
from autopar.passes.trace import TracedGraph, keep_loss_only
from autopar.placement import Outputs


@dataclass
class Prepared:
    """One candidate's pinned axes (``pinned_axes``) and cost tables (None where it is skipped),
    and what building them said, dumped and recorded, for the search to replay in order."""

    fixed: dict | None | NoPlanFitsError
    tables: CostTables | None
    said: list[str]
    writes: list[tuple[str, str]]
    candidates: list[Entry]
    unplaceable: list[str]


def prepare_candidate(pb: Problem, run: MeshRun, cluster: ClusterSpec) -> Prepared:
    """The tables of candidate ``run`` on ``cluster`` (the whole one, or one pipeline stage's)."""
    rec = Recorder(pb.st.dump)
    candidates: list[Entry] = []
    unplaceable: list[str] = []
    tables = None
    fixed = pinned_axes(pb, cluster, run)
    strats = fixed if isinstance(fixed, NoPlanFitsError) else strategies_stage(pb, run, fixed, rec)
    if isinstance(strats, NoPlanFitsError):  # e.g. a batch of one: no data parallelism at all
        entry, why = skip(run, strats, rec)
        candidates.append(entry)
        unplaceable.append(why)
    else:
        tables = cost_stage(pb, strats, cluster, run, rec)
    return Prepared(fixed, tables, rec.said, rec.writes, candidates, unplaceable)


def pinned_axes(pb: Problem, cluster: ClusterSpec, run: MeshRun) -> dict | None | NoPlanFitsError:
    """The axes a candidate pins (``MeshRun.data_outer``: axis 0 to the solution of one axis of its
    size and role, data or expert, solved once per size and role and kept in ``pb.data_axis``),
    None when it pins none, or why there is no such solution."""
    if not run.data_outer:
        return None
    size = run.mesh[0]
    role = run.roles[0] if run.roles else AxisRole.DATA
    key = size if role is AxisRole.DATA else (size, role)
    if key not in pb.data_axis:
        try:
            pb.data_axis[key] = data_parallel_axis(
                pb.tg, pb.infos, cluster, size, pb.options.optimizer, pb.classes, pb.profiler, role,
                pb.table_memos,
            )  # fmt: skip
        except NoPlanFitsError as e:
            pb.data_axis[key] = e
    got = pb.data_axis[key]
    return got if isinstance(got, NoPlanFitsError) else {0: got}


def data_parallel_axis(
    tg: TracedGraph,
    infos: dict[str, NodeInfo],
    cluster: ClusterSpec,
    size: int,
    optimizer: Optimizer,
    classes: Classes | None,
    profiler: NodeTimer | None = None,
    role: AxisRole = AxisRole.DATA,
    memos: dict | None = None,
) -> dict[str, Strategy]:
    """Every node's placement on one data-parallel axis of ``size`` devices: the plan the solver
    picks on the mesh ``(size,)`` with parameters replicated and inputs split on dim 0 (``role``
    ``EXPERT``: the experts split over it). ``memos``: ``build_costs``'s."""
    mesh = (size,)
    roles = (role,)
    strats = build_strategies(tg, infos, mesh, roles, only=set(classes.members) if classes else None)
    tables = build_costs(tg, infos, strats, cluster, mesh, optimizer, roles, classes, profiler, memos=memos)
    sol = solve(tables, math.inf)
    if sol is None:  # no memory limit: cannot happen unless the roles forbid every strategy somewhere
        raise NoPlanFitsError(
            f"no data-parallel placement over {size} devices; pass mesh_shape=... explicitly"
        )
    return {v: tables.strategies[v][i] for v, i in sol.choice.items()}


def strategies_stage(
    pb: Problem, run: MeshRun, fixed: dict | None, st: Stages
) -> dict[str, NodeStrategies] | NoPlanFitsError:
    """Every node's strategies on the candidate's mesh, or why there are none: its axis roles
    leave some tensor no placement (a batch of one on a data-parallel axis, a dim that does not
    divide); the candidate is then skipped, the reason kept for the error should none fit."""
    only = set(pb.classes.members) if pb.classes else None
    try:
        strats = build_strategies(
            pb.tg, pb.infos, run.mesh, run.roles, only=only, fixed=fixed,
            seq_attention=pb.options.sequence_attention,
        )  # fmt: skip
    except NoPlanFitsError as e:
        return e
    if not pb.options.sequence_parallel:
        strats = whole_norms_on_tensor_axes(strats, run.mesh, run.roles)
    if st.dump:
        st.write(f"3_strategies_{run.tag}.tsv", strategies_tsv(strats))
    return strats


def region_stage(pb: Problem, run: MeshRun) -> tuple[dict[str, NodeStrategies], CostTables] | str:
    """The candidate's strategies and tables with its data-parallel region (``passes/data_region.py``:
    found and checked once per number of ranks on the data axis, kept in ``pb.regions``), or why
    there is none."""
    tg, options, regions = pb.tg, pb.options, pb.regions
    data_axes = [a for a, r in enumerate(run.roles or ()) if r.splits_batch]
    parts = region_parts(run.mesh, data_axes)
    if parts not in regions:
        t0 = time.perf_counter()

        def rewrite(other: TracedGraph) -> None:  # as the search rewrote tg (passes/search.py:fuse_stage)
            if options.outputs is Outputs.LOSS:
                keep_loss_only(other)
            fuse(other, {u.kernel for u in tg.kernels})

        rows = trace_rows(pb.model, pb.example_inputs, tg, parts, rewrite)
        if isinstance(rows, str):
            regions[parts] = rows
        else:
            one_axis = build_strategies(tg, pb.infos, (parts,), (AxisRole.DATA,))
            regions[parts] = find_region(tg, rows, pb.infos, one_axis, pb.classes)
        got = regions[parts]
        said = got if isinstance(got, str) else f"{len(got.nodes)} ops run on each rank's own rows"
        pb.st.say(f"data region on {parts} ranks: {said} ({time.perf_counter() - t0:.1f} s)")
    region = regions[parts]
    if isinstance(region, str):
        return region
    only = set(pb.classes.members) if pb.classes else None
    strats = build_strategies(
        tg, pb.infos, run.mesh, run.roles, only=only, seq_attention=options.sequence_attention,
        regions=region.options,
    )  # fmt: skip
    if not options.sequence_parallel:
        strats = whole_norms_on_tensor_axes(strats, run.mesh, run.roles)
    if pb.st.dump:
        pb.st.write(f"3_strategies_{run.tag}.tsv", strategies_tsv(strats))
    return strats, cost_stage(pb, strats, pb.cluster, run, pb.st)


def skip(run: MeshRun, e: NoPlanFitsError, st: Stages) -> tuple[Entry, str]:
    """A candidate whose roles no placement satisfies, skipped (never fatal): its entry and the
    reason the error quotes should no candidate place the model."""
    st.say(f"solve: mesh {run.label}: skipped ({e})")
    return Entry(run.mesh, Verdict.UNPLACEABLE, run.roles), f"mesh {run.label}: {e}"


def cost_stage(
    pb: Problem, strats: dict[str, NodeStrategies], cluster: ClusterSpec, run: MeshRun, st: Stages
) -> CostTables:
    """The candidate's cost tables on ``cluster`` (the whole one, or one pipeline stage's), its
    nodes priced as the cost model prices them (``pb.cinfos``)."""
    options = pb.options
    tables = build_costs(
        pb.tg, pb.cinfos, strats, cluster, run.mesh, options.optimizer, run.roles, pb.classes, pb.profiler,
        options.outputs, options.fuses_matmuls(cluster.device.comm_overlap),
        Float8Offer.of(options.float8, cluster.device), memos=pb.table_memos,
    )  # fmt: skip
    if pb.profiler is not None:
        st.say(f"profile: mesh {run.mesh}: {pb.profiler.take_stats().line()}")
    if st.dump:
        st.write(f"3_costs_{run.tag}.tsv", costs_tsv(tables))
    return tables
