"""Training batch norm on a split batch (or any split dim other than the channels).

Every rank normalizes with the whole batch's statistics: the per-channel sum, then the sum of
squared deviations from the global mean, each all-reduced over the split axes (two passes, as
accurate as the one-device op; ``codegen/lower.py:_lower_batch_norm``). Forward: per split axis in
mesh order, an all-reduce of the sums, then per axis one of the squared deviations; each a
float32-at-least vector of ``C`` channels. Backward: Megatron's "f" on each all-reduced value sums
its gradient's per-rank parts, one all-reduce of the same bytes each.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.lowerings import Collective, Lowering, LoweringCall, LoweringPlan, Phase, register
from autopar.passes.rules.nn import batch_norm_split_axes

aten = torch.ops.aten


def _batch_norm(node: fx.Node, s, mesh_shape: tuple[int, ...]) -> LoweringPlan | None:
    split = batch_norm_split_axes(node, s.ins[0], mesh_shape)
    if not split:
        return None
    x = node.args[0].meta["val"]
    nbytes = int(x.shape[1]) * torch.promote_types(x.dtype, torch.float32).itemsize
    calls = [
        LoweringCall(Collective.ALL_REDUCE, a, nbytes, phase)
        for phase in (Phase.FORWARD, Phase.BACKWARD)
        for _ in ("sums", "squared deviations")
        for a in split
    ]
    return LoweringPlan(tuple(calls))


BATCH_NORM = register(Lowering("batch_norm_statistics", (aten.batch_norm.default,), _batch_norm))
