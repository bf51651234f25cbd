"""Public API: ``search`` and ``plan`` (offline search), ``reprice`` (a plan priced without a search)
and ``autoparallelize`` (search or apply, then run).

Each is a few named steps of the layers below: the search (``passes/search.py``: trace -> analyze
-> coarsen -> strategies -> cost -> solve per mesh candidate -> select -> price; each stage dumpable
with ``dump_dir=...`` or the ``AUTOPAR_DUMP_DIR`` environment variable), a plan replayed on the
model (``passes/replay.py``) and priced there (``passes/reprice.py``), what every rank must share
(``codegen/agree.py``) and the rank-local module (``codegen/build.py``). This module turns the
user's keyword arguments into one ``SearchOptions`` and resolves the op profiler.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from autopar.cluster import ClusterSpec
from autopar.codegen.agree import agree_on_model, agree_on_plan, solve_once
from autopar.codegen.build import build_parallel_module, module_graph
from autopar.errors import DistributedSetupError
from autopar.options import Optimizer, SearchOptions
from autopar.passes.replay import traced_as_planned
from autopar.passes.reprice import given_choice, price_choice
from autopar.passes.search import SearchResult
from autopar.passes.search import search as _search
from autopar.plan import Plan
from autopar.tools.profiler import OpProfiler, resolve_profiler


def search(
    model: torch.nn.Module,
    cluster: ClusterSpec,
    example_inputs,
    options: SearchOptions | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    dump_dir: str | os.PathLike | None = None,
    **overrides,
) -> SearchResult:
    """The search (``passes/search.py``) under ``options`` with ``overrides`` (keyword arguments
    naming fields of ``SearchOptions``: ``mesh_shape=``, ``axis_roles=``, ``memory_limit_bytes=``,
    ``time_limit_s=``, ``optimizer=``, ``outputs=``, ``coarsen=``, ``profile=``). ``profile``:
    True (or an ``OpProfiler``) prices ops by running them on this machine's device (cached, see
    ``autopar.tools.profiler``) instead of the analytical roofline; the cluster's device must be this
    machine's kind, else ProfilerDeviceError."""
    profile = overrides.get("profile", options.profile if options else False)
    if isinstance(profile, OpProfiler):
        overrides["profile"] = True
    options = SearchOptions.of(options, **overrides)
    profiler = resolve_profiler(profile, cluster, progress) if options.profile else None
    return _search(
        model, cluster, example_inputs, options, profiler=profiler, progress=progress, dump_dir=dump_dir
    )


def plan(
    model: torch.nn.Module,
    cluster: ClusterSpec,
    example_inputs,
    options: SearchOptions | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    dump_dir: str | os.PathLike | None = None,
    **overrides,
) -> Plan:
    """Search a sharding plan offline: no process group needed; works on meta-device models.
    ``options`` / keyword arguments: see ``search`` and ``autopar.SearchOptions``
    (``memory_limit_bytes`` is the memory per device, of which ``cluster.memory_reserve`` stays
    unused)."""
    return search(
        model, cluster, example_inputs, options, progress=progress, dump_dir=dump_dir, **overrides
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
    does not record it); ``profile``: as for ``search``. The plan's trades (``autopar/trades.py``)
    are priced as the search prices them, and so is its pipeline (``passes/pipeline.py``: its
    schedule and cuts as the plan has them): ``passes/reprice.py``. The result's solver status is
    "Repriced"; its objective, the cost tables' total on ``cluster``."""
    if isinstance(plan, (str, os.PathLike)):
        plan = Plan.load(plan)
    profiler = resolve_profiler(profile, cluster, None)
    return price_choice(given_choice(model, cluster, example_inputs, plan, optimizer, profiler))


def autoparallelize(
    model: torch.nn.Module,
    cluster: ClusterSpec | None,
    example_inputs,
    *,
    plan: Plan | str | os.PathLike | None = None,
    options: SearchOptions | None = None,
    weights=None,
    **search_kwargs,
):
    """Call on every rank inside an initialized process group; returns the rank-local module.

    ``weights``: where the weights come from when not from ``model`` itself: a Hugging Face
    checkpoint folder or ``.safetensors`` file (each rank reads only its shards), or
    ``autopar.Rank0Weights(state_dict)`` (a state dict rank 0 alone holds; the other ranks pass
    ``Rank0Weights(None)``). With a ``model`` on the meta device and no ``weights``, each rank
    initializes its own shards with the model's initializers (``codegen/weights.py``). No rank
    ever holds the whole model.

    Every rank must pass the same model (same weights) and, at run time, the same full global
    batch: the module slices its own part. Both are checked across ranks, the weights and example
    inputs here and the batch at the module's first call (``CrossRankMismatchError`` on every rank,
    ``codegen/agree.py``). Without a ``plan``, rank 0 searches, builds its module from the search's
    own result and sends the plan to the others, which replay it (``passes/replay.py``): the same
    module on every rank. Gradients and optimizer steps are ordinary PyTorch.
    With ``plan.trades.micro_batches = k > 1`` the module is generated for one micro-batch (``1/k``
    of the example batch): train with ``pmodel.step(**global_batch)`` (``codegen/module.py``).
    """
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
    agree_on_model(model, example_inputs)  # before anything is solved or built (codegen/agree.py)
    if isinstance(plan, (str, os.PathLike)):
        plan = Plan.load(plan)
    choice = None
    if plan is None:  # solved on rank 0 only, which builds from its own result; the others replay the plan
        found, plan = solve_once(lambda: _searched(model, cluster, example_inputs, options, search_kwargs))
        if found is not None:
            tg, choice = found.traced, found.choice
        else:
            tg = traced_as_planned(model, example_inputs, plan)
    else:
        agree_on_plan(plan)
        plan.check_world(world)  # before tracing: the likelier mistake, and the cheaper check
        tg = traced_as_planned(model, example_inputs, plan)
        plan.check_matches(tg.fingerprint(), world)
    graph = module_graph(model, example_inputs, plan, tg, choice)
    return build_parallel_module(model, graph.traced, plan, graph.choice, graph.inputs, weights=weights)


def _searched(model, cluster, example_inputs, options, search_kwargs: dict) -> tuple[SearchResult, Plan]:
    result = search(model, cluster, example_inputs, options, **search_kwargs)
    return result, result.plan
