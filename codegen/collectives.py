"""Autograd-aware collectives over one mesh axis, as the generated code calls them.

Gradient convention (the one ``cost_model/comm.py`` prices): the gradient of a Replicate or
Partial value is the full gradient on every rank; the gradient of a Shard value is the shard.
Under it, each function's backward is:

=================  ==========================  ======================================
function           forward                     backward
=================  ==========================  ======================================
all_gather         concat shards along dim     local slice (or reduce-scatter, fused)
chunk              local slice along dim       all-gather
all_reduce         sum (Partial -> Replicate)  identity
reduce_scatter     sum + slice                 all-gather
to_partial         keep on coordinate 0        identity
f                  identity                    all-reduce (Megatron-LM's "f")
=================  ==========================  ======================================

The generated module names the mesh axis, not a process group; ``set_mesh`` binds axes to the
groups of the live DeviceMesh. Gloo lacks some collectives on some versions; where it does,
reduce-scatter runs as all-reduce + slice (priced the same way by the cost model's calibration).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.errors import DistributedSetupError
from autopar.placement import is_partial, is_shard

_MESH: DeviceMesh | None = None


def set_mesh(mesh: DeviceMesh) -> None:
    global _MESH
    _MESH = mesh


def _group(axis: int):
    if _MESH is None:
        raise DistributedSetupError("no device mesh is bound: build the module with autopar.autoparallelize")
    return _MESH.get_group(axis)


def _size(axis: int) -> int:
    return _MESH.size(axis)  # type: ignore[union-attr]


def _coord(axis: int) -> int:
    return _MESH.get_local_rank(axis)  # type: ignore[union-attr]


# ``all_gather_single`` is ``all_gather_into_tensor``'s newer name (torch >= 2.13 warns on the old one)
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather(x: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
    x = x.contiguous()
    n = _size(axis)
    if dim % x.dim() == 0:
        # the pieces are consecutive: gathered straight into the result. No list of parts, which
        # the backend's worker thread holds until it lets go of the work (on gloo, a race with the
        # caller: up to n L bytes more, for a while), and no copy into a concatenation
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        _gather_into(out, x, group=_group(axis))
        return out
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=_group(axis))
    return torch.cat(parts, dim=dim)


def _slice(x: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
    # a copy even where the piece is contiguous (dim 0): a view would keep all of x alive with it
    return x.chunk(_size(axis), dim=dim)[_coord(axis)].clone(memory_format=torch.contiguous_format)


def _all_reduce(x: torch.Tensor, axis: int) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=_group(axis))
    return x


def _reduce_scatter(x: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
    if dist.get_backend(_group(axis)) == "nccl":
        x = x.movedim(dim, 0).contiguous()
        out = torch.empty((x.shape[0] // _size(axis),) + x.shape[1:], dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, group=_group(axis))
        return out.movedim(0, dim).contiguous()
    return _slice(_all_reduce(x, axis), dim, axis)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis, fused_f):
        ctx.dim, ctx.axis, ctx.fused_f = dim, axis, fused_f
        return _gather(x, dim, axis)

    @staticmethod
    def backward(ctx, g):
        if ctx.fused_f:
            return _reduce_scatter(g, ctx.dim, ctx.axis), None, None, None
        return _slice(g, ctx.dim, ctx.axis), None, None, None


class _Chunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis):
        ctx.dim, ctx.axis = dim, axis
        return _slice(x, dim, axis)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.axis), None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        return _all_reduce(x, axis)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis):
        ctx.dim, ctx.axis = dim, axis
        return _reduce_scatter(x, dim, axis)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.axis), None, None


class _ToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        return x.clone() if _coord(axis) == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.axis), None


def coordinate(axis: int) -> int:
    """This rank's coordinate on mesh axis ``axis`` (for local ops that depend on it)."""
    return _coord(axis)


# The names the generated code calls. Non-tensor inputs (e.g. integer masks) go through unchanged in backward.
def all_gather(x: torch.Tensor, dim: int, axis: int, fused_f: bool = False) -> torch.Tensor:
    return _AllGather.apply(x, dim, axis, fused_f)


def chunk(x: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
    return _Chunk.apply(x, dim, axis)


def all_reduce(x: torch.Tensor, axis: int) -> torch.Tensor:
    return _AllReduce.apply(x, axis)


def reduce_scatter(x: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
    return _ReduceScatter.apply(x, dim, axis)


def to_partial(x: torch.Tensor, axis: int) -> torch.Tensor:
    return _ToPartial.apply(x, axis)


def f(x: torch.Tensor, axis: int) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward."""
    return _F.apply(x, axis)


@torch.no_grad()
def gather_full(x: torch.Tensor, spec, mesh_shape) -> torch.Tensor:
    """Rebuild the full tensor from this rank's piece (no autograd): for checkpoints and comparison."""

    for a, p in enumerate(spec):
        if mesh_shape[a] == 1:
            continue
        if is_shard(p):
            x = _gather(x, p.dim, a)
        elif is_partial(p):
            x = _all_reduce(x, a)
    return x
