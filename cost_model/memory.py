"""Memory in bytes per device: what the collectives of a reshard allocate while they run.

The steps and the bytes each holds are those of the reshard plan (``autopar/reshard.py``, whose
docstring has the table, read off ``codegen/collectives.py``): the same steps codegen emits and
the communication model prices.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Placement

from autopar.reshard import reshard_plan


def reshard_transient(
    src: Sequence[Placement],
    dst: Sequence[Placement],
    nbytes: float,
    mesh_shape: Sequence[int],
    requires_grad: bool,
    f_axes: Sequence[int] = (),
    keeps: bool = False,
) -> float:
    """Largest bytes per device the collectives moving a tensor of ``nbytes`` (global) from ``src``
    to ``dst`` hold at once, forward or backward (``ReshardPlan.transient``); 0 when nothing runs.
    ``keeps``: the consumer keeps the resharded tensor until backward (its output is counted there)."""
    plan = reshard_plan(tuple(src), tuple(dst), tuple(mesh_shape), nbytes, tuple(f_axes))
    return plan.transient(requires_grad, keeps)
