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


def same(a: Placement, b: Placement, ndim: int) -> bool:
    if is_shard(a) and is_shard(b):
        return a.dim % max(ndim, 1) == b.dim % max(ndim, 1)
    return type(a) is type(b)


def torch_layout(p: Placement, ndim: int) -> Placement:
    """``p`` as a style's layout: ``Shard(-1)`` for the last dim (what PyTorch's styles default to)."""
    if is_shard(p) and p.dim % max(ndim, 1) == ndim - 1:
        return Shard(-1)
    return Shard(p.dim % ndim) if is_shard(p) else Replicate()


def text(p: Placement) -> str:
    return f"S({p.dim})" if is_shard(p) else "R" if is_replicate(p) else "P"
