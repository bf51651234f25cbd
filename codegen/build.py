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
    if trades.recompute is not Recompute.NONE or trades.zero_stage >= ZeroStage.GRADIENTS:
        # one submodule per repeated block, owning its parameters (codegen/blocks.py): recomputed
        # one at a time; under ZeRO 2 and 3 one FSDP2 group each, so that a block's gradients are
        # reduce-scattered as its backward ends (one group would hold every full gradient)
        gm = apply_recompute(split_blocks(gm, find_blocks(tg), tg.graph), trades.recompute, mesh)
    out_node = next(n for n in tg.graph.nodes if n.op == "output")
    output_specs = tuple(
        output_placement(choice[resolve_source(leaf).name].out, outputs)
        if isinstance(leaf, fx.Node) and isinstance(leaf.meta.get("val"), torch.Tensor)
        else None
        for leaf in pytree.tree_leaves(out_node.args[0])
    )
    names = {p.name: p.target for p in tg.placeholders}
    # the plan's trades (ZeRO, mixed precision, offload: codegen/zero.py); the gradients FSDP2
    # reduces are not bucketed again
    zero = apply_trades(getattr(plan, "trades", None), gm, mesh, tg, deferred)
    buckets = grad_buckets(tg, choice, zero.bucketed(deferred), plan.mesh_shape)
    grad_sync = GradSync([([attrs[mangle(names[n])] for n in b.params], b.axes) for b in buckets], mesh)
    args, kwargs = inputs
    flat = pytree.tree_leaves((args, kwargs))
    return ParallelModule(
        local=gm,
        mesh=mesh,
        in_spec=tg.in_spec,
        kwarg_order=list(kwargs),
        input_shapes=[tuple(t.shape) for t in flat],
        out_spec=tg.out_spec,
        state_specs=state_specs,
        aliases=aliases,
        extra_state=extra,
        device=device,
        plan=plan,
        grad_sync=grad_sync,
        output_specs=output_specs,
        zero=zero,
    )
