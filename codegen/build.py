"""Build the rank-local ParallelModule from a plan: device mesh, local shards, lowered graph.

The DeviceMesh made here is handed explicitly to what runs collectives: the ParallelModule (which
binds it around each forward call, ``codegen/collectives.py``) and its GradSync (whose backward
hooks reduce on its groups). No mesh is kept in a global, so modules built on different meshes
coexist in one process.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.codegen.blocks import apply_recompute, split_blocks
from autopar.codegen.feeding import input_names
from autopar.codegen.grad_sync import GradSync
from autopar.codegen.local_params import attach_leaves
from autopar.codegen.loss_weights import loss_weights
from autopar.codegen.lower import batch_axis, lower, mangle
from autopar.codegen.micro_batches import MicroBatchError, check_same_graph, micro_batch_inputs
from autopar.codegen.module import ParallelModule, defer_output_sums
from autopar.codegen.weights import StandIns
from autopar.codegen.zero import HALF, apply_trades
from autopar.errors import DistributedSetupError, PlanFormatError
from autopar.lowerings.experts import packed_weights
from autopar.passes.blocks import find_blocks
from autopar.passes.costs import resolve_source
from autopar.passes.grad_sync import deferred_grad_axes, grad_buckets
from autopar.passes.precision import grad_dtype
from autopar.passes.replay import (
    check_choice,
    choice_from_plan,
    in_graph_order,
    plan_regions,
    traced_as_planned,
)
from autopar.passes.strategies import Strategy
from autopar.passes.trace import Role, TracedGraph, normalize_inputs
from autopar.passes.trade_terms import zero_one_axes
from autopar.placement import Outputs, output_placement
from autopar.trades import Recompute, Schedule, Trades, ZeroStage


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class ModuleGraph:
    """What a rank-local module is generated from: the traced graph, the example inputs it was
    traced on (``(args, kwargs)``) and every node's strategy."""

    traced: TracedGraph
    inputs: tuple[tuple, dict]
    choice: dict[str, Strategy]


def _grad_buckets(tg: TracedGraph, choice, deferred: dict, plan) -> list:
    """The gradient buckets as the cost model forms them (``passes/grad_sync.py:grad_buckets``):
    by what they hold at run time (fp32 masters' gradients under mixed precision), and under ZeRO-1
    reduce-scattered into the shares where its optimizer cuts them."""
    trades = getattr(plan, "trades", None)
    gd = grad_dtype(trades.precision) if trades is not None else None
    return grad_buckets(
        tg, choice, deferred, plan.mesh_shape, grad_dtype=gd, scatter_axes=zero_one_axes(trades)
    )


def module_graph(
    model, example_inputs, plan, traced: TracedGraph, choice: dict[str, Strategy] | None = None
) -> ModuleGraph:
    """The graph the module of ``plan`` is generated from: ``traced`` (the model traced as planned,
    on the global batch, whose fingerprint the plan matched) or, with ``plan.trades.micro_batches =
    k > 1``, one micro-batch's: the model traced again on the first ``B / k`` rows of every input,
    the same nodes as ``traced`` (``codegen/micro_batches.py``). ``choice``: the search's own, where
    this process searched the plan, else read from the plan (``passes/replay.py``); either way the
    same strategies, checked against the rules on a micro-batch's graph."""
    k = plan.trades.micro_batches
    if k == 1:
        # also stores the region nodes' arguments on the plan's rows: a searched graph may hold
        # those of another candidate's data axis
        regions = plan_regions(model, traced, plan, example_inputs)
        if choice is None:
            choice = choice_from_plan(traced, plan, regions)
        else:  # as the plan lists its decisions
            choice = in_graph_order(traced, choice)
        return ModuleGraph(traced, normalize_inputs(example_inputs), choice)
    micro = micro_batch_inputs(example_inputs, plan)
    mtg = traced_as_planned(model, micro, plan)
    check_same_graph(traced, mtg, k)
    try:
        regions = plan_regions(model, mtg, plan, micro)
        if choice is None:
            choice = choice_from_plan(mtg, plan, regions)
        else:
            check_choice(mtg, plan.mesh_shape, choice, regions)
            choice = in_graph_order(mtg, choice)
    except PlanFormatError as e:
        raise MicroBatchError(
            f"the plan's placements do not fit micro-batches of 1/{k} of the batch: {e}. Use a larger batch "
            "or fewer micro-batches"
        ) from e
    return ModuleGraph(mtg, normalize_inputs(micro), choice)


def build_parallel_module(
    model, tg: TracedGraph, plan, choice: dict[str, Strategy], inputs, weights=None
) -> ParallelModule:
    """The rank-local module of ``plan``; ``weights``: where the state comes from where not from the
    model's own tensors (``codegen/weights.py``: a checkpoint path, ``Rank0Weights``; a model on
    the meta device without them is initialized shard by shard)."""
    device = _device()
    pipe = getattr(plan, "pipeline", None)
    full_mesh = None
    if pipe is not None and pipe.enabled:
        full_mesh, mesh = pipeline_meshes(device, pipe.stages, tuple(plan.mesh_shape))
    else:
        mesh = device_mesh(device.type, tuple(plan.mesh_shape), axis_names(len(plan.mesh_shape)))
    model_state = model.state_dict(keep_vars=True)
    # tied weights appear once in the graph under one name: map every state-dict name to that one
    traced_by_id = {id(t): name for name, t in model_state.items() if name in tg.state}
    aliases, extra = {}, {}
    for name, t in model_state.items():
        fqn = name if name in tg.state else traced_by_id.get(id(t))
        aliases[name] = fqn if fqn is not None else name
        if fqn is None:  # state the graph never reads (e.g. an unused buffer): returned as it was
            extra[name] = t.detach().clone()

    # the module's state carries the plan's placements (the graph reads the local pieces,
    # collectives.local): clip_grad_norm_, optimizers and checkpoints see the sharding. Lowered on
    # meta stand-ins, made real group by group (codegen/weights.py): a pipelined rank makes only
    # what its chunks read, ZeRO-2/3 one FSDP2 group at a time
    specs = {p.target: choice[p.name].out for p in tg.placeholders if p.role is not Role.INPUT}
    # packed gate-up weights split on their 2I dim, kept permuted (autopar/lowerings/experts.py)
    packed = packed_weights(tg.graph, choice, plan.mesh_shape)
    stored = {p.target: packed[p.name] for p in tg.placeholders if p.name in packed}
    state = StandIns(model, tg, specs, aliases, mesh, plan.mesh_shape, device, weights, stored)
    state_specs = {t: (mangle(t), spec) for t, spec in specs.items()}
    deferred = deferred_grad_axes(tg, choice, plan.mesh_shape)
    outputs = Outputs(plan.outputs)
    trades = getattr(plan, "trades", Trades())
    gm = lower(
        tg, choice, plan.mesh_shape, state.attrs, deferred, outputs, getattr(plan, "overlap_matmuls", False),
        getattr(plan, "float8_linears", None), HALF.get(trades.precision),
    )  # fmt: skip
    common = _module_kwargs(model, tg, plan, choice, inputs, outputs) | dict(
        mesh=mesh, state_specs=state_specs, aliases=aliases, extra_state=extra, device=device, stored=stored
    )
    if full_mesh is not None:
        state.load(gm, _pipeline_targets(tg, plan, gm, full_mesh))  # only what this rank's chunks read
        attrs = {a: operator.attrgetter(a)(gm) for a in state.attrs}
        return _pipelined(tg, plan, choice, gm, mesh, full_mesh, attrs, deferred, common)
    # the returned loss's all-reduce is waited for where it is read, not in forward (rewritten
    # before FSDP2 or the blocks' split wrap the graph module)
    gm = defer_output_sums(gm)
    if trades.recompute is not Recompute.NONE or trades.zero_stage >= ZeroStage.GRADIENTS:
        # one submodule per repeated block, owning its parameters (codegen/blocks.py): recomputed
        # one at a time; under ZeRO 2 and 3 one FSDP2 group each, so that a block's gradients are
        # reduce-scattered as its backward ends (one group would hold every full gradient)
        blocks = find_blocks(tg)
        gm = apply_recompute(
            split_blocks(gm, blocks, tg.graph), trades.recompute, mesh, tg.graph, blocks,
            trades.recomputed(len(blocks)),
        )  # fmt: skip
    names = {p.name: p.target for p in tg.placeholders}
    # the plan's trades (ZeRO, mixed precision, offload: codegen/zero.py); the gradients FSDP2
    # reduces are not bucketed again
    zero = apply_trades(getattr(plan, "trades", None), gm, mesh, tg, deferred, state.load)
    buckets = _grad_buckets(tg, choice, zero.bucketed(deferred), plan)
    # the plain leaves the forward computes on (codegen/local_params.py); FSDP2's parameters are
    # gathered into tensors of its own before each forward, so under ZeRO 2 and 3 those get
    # theirs as FSDP2 gathers them (codegen/zero.py:_gathered_leaves); those FSDP2 leaves alone, here
    leaves = attach_leaves(gm.parameters() if trades.zero_stage < ZeroStage.GRADIENTS else zero.ignored)
    zero.mark_half_reads(gm.parameters())  # mixed precision: read as half copies (local_params.py)
    # the parameters as the module holds them now (the pieces made after lowering, FSDP2's shards)
    grad_sync = GradSync(
        [([getattr(gm, mangle(names[n])) for n in b.params], b.axes, b.scatter) for b in buckets], mesh
    )
    return ParallelModule(local=gm, grad_sync=grad_sync, zero=zero, leaves=leaves, **common)


def _pipeline_targets(tg: TracedGraph, plan, gm: fx.GraphModule, full_mesh) -> set[str]:
    """The state a pipelined rank holds: what its chunks read, every buffer and every parameter no
    chunk reads (``_pipelined``'s spare state)."""
    from autopar.codegen.pipeline import split_chunks

    pipe = plan.pipeline
    p = full_mesh.get_local_rank("pp")
    mine = {c for c in range(pipe.chunks) if pipe.rank_of_chunk(c) == p}
    read = {t for c in split_chunks(gm, tg.graph, find_blocks(tg), pipe, mine) for t in c.state}
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr" and n.users}
    return {
        pp.target
        for pp in tg.placeholders
        if pp.role is not Role.INPUT
        and (mangle(pp.target) in read or pp.role is not Role.PARAM or mangle(pp.target) not in used)
    }


def _module_kwargs(
    model, tg: TracedGraph, plan, choice: dict[str, Strategy], inputs, outputs: Outputs
) -> dict:
    """What every rank-local module is built with from the traced graph and the plan: the inputs'
    structure, names, shapes and batch-splitting axes, the outputs' structure and placements."""
    out_node = next(n for n in tg.graph.nodes if n.op == "output")
    micro_batches = getattr(plan, "trades", Trades()).micro_batches
    pipelined = getattr(getattr(plan, "pipeline", None), "enabled", False)
    output_specs = tuple(
        output_placement(choice[resolve_source(leaf).name].out, outputs)
        if isinstance(leaf, fx.Node) and isinstance(leaf.meta.get("val"), torch.Tensor)
        else None
        for leaf in pytree.tree_leaves(out_node.args[0])
    )
    args, kwargs = inputs
    return dict(
        in_spec=tg.in_spec,
        kwarg_order=list(kwargs),
        input_shapes=[tuple(t.shape) for t in pytree.tree_leaves((args, kwargs))],
        arg_names=input_names(model, args, kwargs),
        batch_axes=[
            batch_axis(choice[p.name].out, plan.mesh_shape) for p in tg.placeholders if p.role is Role.INPUT
        ],
        out_spec=tg.out_spec,
        plan=plan,
        output_specs=output_specs,
        # how step weighs its micro-batches' losses: by the labels each counts (codegen/loss_weights.py);
        # an unpipelined module's forward also counts the whole batch's labels with it, where it is fed
        # the whole batch, rather than all-reduce the ranks' counts (ParallelModule._known_count)
        loss_weights=loss_weights(tg) if micro_batches > 1 or not pipelined else None,
    )


# one DeviceMesh object per (device type, shape, axis names) in a process, all on the process
# group ``_MESH_WORLD`` holds (held, so that a later group cannot take its id)
_MESHES: dict[tuple, DeviceMesh] = {}
_MESH_WORLD: list = [None]


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """The mesh of ``shape`` with axes ``names``, made once per process group (collective the first
    time).

    Modules built on equal meshes share one object: DTensor's sharding propagation caches its
    output placements by value, so a ``DTensor`` made on a second, equal mesh object comes back
    from any op (``nn.Parameter``'s ``detach`` is one) on the first; FSDP2 then refuses parameters
    whose mesh is not the very object it is given."""
    world = dist.group.WORLD
    if _MESH_WORLD[0] is not world:
        _forget_meshes()
        _MESH_WORLD[0] = world
    key = (device_type, tuple(shape), tuple(names))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    return _MESHES[key]


def _forget_meshes() -> None:
    """The process group the cached meshes were made on is not the world's (a new one was
    initialized in this process, or none was made yet): drop them, and DTensor's caches keyed by mesh *value*. Those would hand a
    ``DTensor`` made on the new, equal mesh back on an old one (its sharding propagation caches
    specs by an equality that ignores the process group), which FSDP2 refuses ("Expected param's
    DTensor mesh to be the same mesh passed to fully_shard")."""
    from torch.distributed.tensor import DTensor, _redistribute

    _MESHES.clear()
    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    caches = (
        getattr(propagator, "propagate_op_sharding", None),
        getattr(propagator, "_propagate_tensor_meta_cached", None),
        getattr(_redistribute, "_gen_transform_infos", None),
    )
    for cache in caches:
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
    for clear in (
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),  # the C++ fast path's
    ):
        if clear is not None:
            clear()


def axis_names(n: int) -> tuple[str, ...]:
    """The names of a plan mesh's axes: ``axis0``, ``axis1``, ... (FSDP2 names its data axis)."""
    return tuple(f"axis{a}" for a in range(n))


def pipeline_meshes(device: torch.device, stages: int, stage_mesh: tuple[int, ...]):
    """(the whole mesh: ``pp`` outermost, then the stage mesh's axes; this rank's stage mesh)."""
    names = ("pp", *axis_names(len(stage_mesh)))
    full = device_mesh(device.type, (stages, *stage_mesh), names)
    return full, full[names[1:] if len(names) > 2 else names[1]]


def _pipelined(tg, plan, choice, gm, mesh, full_mesh, attrs, deferred, common: dict):
    """The ``PipelinedModule`` of a pipelined plan (``codegen/pipeline.py``): this rank's chunks of
    the lowered graph ``gm``, the tied parameters' groups, the stage mesh's gradient buckets;
    ``common``: ``ParallelModule``'s other keyword arguments."""
    from autopar.codegen.pipeline import PipelinedModule, chunk_of_nodes, split_chunks

    pipe = plan.pipeline
    trades = plan.trades
    if trades.zero_stage >= ZeroStage.GRADIENTS:
        raise DistributedSetupError(
            f"pipelined plans run with ZeRO 0 or 1 (FSDP2's groups do not run under the schedules here); this "
            f"plan has {trades.describe()}: re-plan with zero_stage<=1, or without pipeline stages"
        )
    blocks = find_blocks(tg)
    if len(blocks) < pipe.chunks:
        raise DistributedSetupError(
            f"the plan's pipeline has {pipe.chunks} chunks but the model has {len(blocks)} repeated blocks"
        )
    p = full_mesh.get_local_rank("pp")
    mine = {c for c in range(pipe.chunks) if pipe.rank_of_chunk(c) == p}
    chunk, _ = chunk_of_nodes(gm, tg.graph, blocks, pipe)
    # parameters read by chunks on several pipeline ranks: one group per stage-mesh position
    readers: dict[str, set[int]] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), torch.nn.Parameter):
            readers.setdefault(n.target, set()).update(
                pipe.rank_of_chunk(chunk[u]) for u in n.users if u in chunk
            )
    m = mesh.size()
    here = dist.get_rank() % m
    tied, groups = [], {}
    for target in sorted(t for t, r in readers.items() if len(r) > 1):
        ranks = tuple(sorted(readers[target]))
        if ranks not in groups:
            for j in range(m):  # every rank creates every group, in the same order
                g = dist.new_group([r * m + j for r in ranks])
                if j == here:
                    groups[ranks] = g
        if p in ranks:
            tied.append((target, groups[ranks]))
    chunks = split_chunks(gm, tg.graph, blocks, pipe, mine)
    if trades.recompute is not Recompute.NONE:  # each chunk's blocks checkpointed (codegen/blocks.py)
        for c in chunks:
            own = [b for b in blocks if pipe.chunk_of_block(b.index) == c.index]
            c.module = apply_recompute(
                split_blocks(c.module, own, tg.graph), trades.recompute, mesh, tg.graph, own,
                trades.recomputed(len(blocks), pipe.cuts, pipe.stages),  # the first of each stage (Megatron's)
            )  # fmt: skip
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr" and n.users}
    zero = apply_trades(trades, gm, mesh, tg, deferred)
    held = {id(v) for c in chunks for v in c.params.values()}
    # the plain leaves the chunks compute on (codegen/local_params.py), attached before GradSync
    # registers its hooks on them; none under a schedule that splits backward into its input and
    # weight halves (zero bubble): torch's stage finds the weights' autograd nodes through the
    # chunk module's parameters, which must then be the tensors the graph reads
    leaves = (
        []
        if pipe.schedule is Schedule.ZERO_BUBBLE
        else attach_leaves(v for c in chunks for v in c.params.values())
    )
    zero.mark_half_reads(v for c in chunks for v in c.params.values())  # once a step (local_params.py)
    names = {p.name: p.target for p in tg.placeholders}
    buckets = _grad_buckets(tg, choice, zero.bucketed(deferred), plan)
    grad_sync = GradSync(
        [
            (ps, b.axes, b.scatter)
            for b in buckets
            if (ps := [attrs[mangle(names[n])] for n in b.params if id(attrs[mangle(names[n])]) in held])
        ],
        mesh,
    )
    return PipelinedModule(
        chunks=chunks,
        full_mesh=full_mesh,
        tied=tied,
        spare={a: t for a, t in attrs.items() if not isinstance(t, torch.nn.Parameter) or a not in read},
        input_names=[n.name for n in gm.graph.nodes if n.op == "placeholder"],
        grad_sync=grad_sync,
        zero=zero,
        leaves=leaves,
        **common,
    )
