"""What the export's parts share: its error and how placements are compared and written."""

from __future__ import annotations

from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from autopar.errors import AutoparError
from autopar.placement import is_replicate, is_shard
from autopar.plan import NodeDecision


class ExportError(AutoparError, ValueError):
    """The plan decides something PyTorch's module plans cannot express: the message names the
    decision (node, module, axis) and what to plan instead."""


def seq_attention(d: NodeDecision, axis: int) -> ExportError:
    return ExportError(
        f"node {d.name} ({d.module or d.op}) runs attention on a sequence split over mesh axis {axis} "
        f"({d.via}): context parallelism has no parallelize_module style; plan with "
        "sequence_attention='gather' or without AxisRole.SEQUENCE"
    )


def grid_matmul(d: NodeDecision) -> ExportError:
    return ExportError(
        f"node {d.name} ({d.module or d.op}) runs a {'3D' if '3d' in d.via.split(',') else '2D'} "
        f"tensor-parallel matmul ({d.via}): PyTorch's "
        "parallelize_module styles split a weight on one axis only; plan without it (edit the decision "
        "to a one-axis strategy) to export"
    )


def same(a: Placement, b: Placement, ndim: int) -> bool:
    """Whether ``a`` and ``b`` place a tensor of ``ndim`` dims alike (``Shard(-1)`` is its last dim)."""
    if is_shard(a) and is_shard(b):
        return a.dim % ndim == b.dim % ndim if ndim > 0 else a.dim == b.dim
    return type(a) is type(b)


def torch_layout(p: Placement, ndim: int) -> Placement:
    """``p`` as a style's layout: ``Shard(-1)`` for the last dim (what PyTorch's styles default to)."""
    if not is_shard(p):
        return Replicate()
    if ndim <= 0:
        return Shard(p.dim)
    return Shard(-1) if p.dim % ndim == ndim - 1 else Shard(p.dim % ndim)


def text(p: Placement) -> str:
    """The plan's text of one placement (``R``, ``S(d)``, ``P``)."""
    return f"S({p.dim})" if is_shard(p) else "R" if is_replicate(p) else "P"
