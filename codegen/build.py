"""Build the rank-local ParallelModule from a plan: device mesh, local shards, lowered graph.

The DeviceMesh made here is handed explicitly to what runs collectives: the ParallelModule (which
binds it around each forward call, ``codegen/collectives.py``) and its GradSync (whose backward
hooks reduce on its groups). No mesh is kept in a global, so modules built on different meshes
coexist in one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import init_device_mesh

from autopar.codegen.blocks import apply_recompute, split_blocks
from autopar.codegen.grad_sync import GradSync
from autopar.codegen.lower import lower, mangle
from autopar.codegen.module import ParallelModule, local_piece
from autopar.codegen.zero import apply_trades
from autopar.errors import DistributedSetupError
from autopar.passes.blocks import find_blocks
from autopar.passes.costs import resolve_source
from autopar.passes.grad_sync import deferred_grad_axes, grad_buckets
from autopar.passes.strategies import Strategy
from autopar.passes.trace import Role, TracedGraph
from autopar.placement import Outputs, output_placement
from autopar.trades import Recompute, Trades, ZeroStage


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_parallel_module(
    model, tg: TracedGraph, plan, choice: dict[str, Strategy], inputs
) -> ParallelModule:
    device = _device()
    pipe = getattr(plan, "pipeline", None)
    full_mesh = None
    if pipe is not None and pipe.enabled:
        full_mesh, mesh = pipeline_meshes(device, pipe.stages, tuple(plan.mesh_shape))
    else:
        mesh = init_device_mesh(device.type, tuple(plan.mesh_shape))
    model_state = model.state_dict(keep_vars=True)
    # tied weights appear once in the graph under one name: map every state-dict name to that one
    traced_by_id = {id(t): name for name, t in model_state.items() if name in tg.state}
    aliases, extra = {}, {}
    for name, t in model_state.items():
        fqn = name if name in tg.state else traced_by_id.get(id(t))
        aliases[name] = fqn if fqn is not None else name
        if fqn is None:  # state the graph never reads (e.g. an unused buffer): returned as it was
            extra[name] = t.detach().clone()

    attrs: dict[str, torch.Tensor] = {}
    state_specs = {}
    for p in tg.placeholders:
        if p.role is Role.INPUT:
            continue
        full = tg.state[p.target]
        if full.is_meta:
            raise DistributedSetupError(
                f"{p.target} is on the meta device: autoparallelize needs real weights on every rank "
                "(plan meta-device models offline with autopar.plan)"
            )
        spec = choice[p.name].out
        piece = local_piece(full.detach(), spec, mesh).to(device).clone()
        if p.role is Role.PARAM:
            piece = torch.nn.Parameter(piece, requires_grad=full.requires_grad)
        attrs[mangle(p.target)] = piece
        state_specs[p.target] = (mangle(p.target), spec)

    deferred = deferred_grad_axes(tg, choice, plan.mesh_shape)
    outputs = Outputs(plan.outputs)
    gm = lower(tg, choice, plan.mesh_shape, device, attrs, deferred, outputs)
    trades = getattr(plan, "trades", Trades())
    common = _module_kwargs(tg, plan, choice, inputs, outputs) | dict(
        mesh=mesh, state_specs=state_specs, aliases=aliases, extra_state=extra, device=device
    )
    if full_mesh is not None:
        return _pipelined(tg, plan, choice, gm, mesh, full_mesh, attrs, deferred, common)
    if trades.recompute is not Recompute.NONE or trades.zero_stage >= ZeroStage.GRADIENTS:
        # one submodule per repeated block, owning its parameters (codegen/blocks.py): recomputed
        # one at a time; under ZeRO 2 and 3 one FSDP2 group each, so that a block's gradients are
        # reduce-scattered as its backward ends (one group would hold every full gradient)
        gm = apply_recompute(split_blocks(gm, find_blocks(tg), tg.graph), trades.recompute, mesh)
    names = {p.name: p.target for p in tg.placeholders}
    # the plan's trades (ZeRO, mixed precision, offload: codegen/zero.py); the gradients FSDP2
    # reduces are not bucketed again
    zero = apply_trades(getattr(plan, "trades", None), gm, mesh, tg, deferred)
    buckets = grad_buckets(tg, choice, zero.bucketed(deferred), plan.mesh_shape)
    grad_sync = GradSync([([attrs[mangle(names[n])] for n in b.params], b.axes) for b in buckets], mesh)
    return ParallelModule(local=gm, grad_sync=grad_sync, zero=zero, **common)


def _module_kwargs(tg: TracedGraph, plan, choice: dict[str, Strategy], inputs, outputs: Outputs) -> dict:
    """What every rank-local module is built with from the traced graph and the plan: the inputs'
    structure and shapes, the outputs' structure and placements."""
    out_node = next(n for n in tg.graph.nodes if n.op == "output")
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
        out_spec=tg.out_spec,
        plan=plan,
        output_specs=output_specs,
    )


def pipeline_meshes(device: torch.device, stages: int, stage_mesh: tuple[int, ...]):
    """(the whole mesh: ``pp`` outermost, then the stage mesh's axes; this rank's stage mesh)."""
    names = ("pp", *(f"axis{a}" for a in range(len(stage_mesh))))
    full = init_device_mesh(device.type, (stages, *stage_mesh), mesh_dim_names=names)
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
            c.module = apply_recompute(split_blocks(c.module, own, tg.graph), trades.recompute, mesh)
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr" and n.users}
    zero = apply_trades(trades, gm, mesh, tg, deferred)
    held = {id(v) for c in chunks for v in c.params.values()}
    names = {p.name: p.target for p in tg.placeholders}
    buckets = grad_buckets(tg, choice, zero.bucketed(deferred), plan.mesh_shape)
    grad_sync = GradSync(
        [
            (ps, b.axes)
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
        **common,
    )
