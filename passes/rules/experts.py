"""Sharding rules of the mixture-of-experts op ``autopar::moe_experts`` (``kernels/moe.py``,
substituted for each MoE layer by ``passes/experts.py``).

Inputs: tokens ``x [T, H]``, router weights and ids ``[T, k]``, then the experts' weights
``[E, ...]`` (two or three). On one mesh axis of ``n`` ranks:

* **data parallel**: tokens, weights and ids split on their rows, experts whole: each rank runs
  its tokens through every expert; rows out.
* **expert parallel** (``ExpertDispatch.ALL_TO_ALL``): tokens split on their rows and experts
  split on ``E`` (rank ``r`` holds experts ``r E / n .. (r + 1) E / n - 1``): each (token, expert)
  pair is sent to its expert's rank and its result back, by all-to-all
  (``autopar/lowerings/experts.py`` prices it, ``codegen/experts.py`` runs it); rows out.
* **local experts**: tokens whole, experts split on ``E``: each rank runs the pairs routed to the
  experts it holds and leaves the others out: its output is a summand (Partial) of the layer's.

Experts split on at most one axis of more than one rank, and by the all-to-all only there
(``experts_strategies``): the dispatch runs over one axis's group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import Shard

from autopar.kernels import moe  # noqa: F401  (registers autopar::moe_experts)
from autopar.passes.rules import AxisOption, OpCtx, P, R, _partial_ok, register
from autopar.placement import ExpertDispatch, is_shard

S0 = Shard(0)
MOE = torch.ops.autopar.moe_experts.default


def experts_rule(ctx: OpCtx) -> list[AxisOption]:
    tokens, experts = ctx.in_shapes[0][0], ctx.in_shapes[3][0]
    n_w = ctx.n_in - 3
    opts = []
    if tokens > 1:
        opts.append(AxisOption(S0, (S0, S0, S0) + (R,) * n_w))
        if experts > 1:
            opts.append(AxisOption(S0, (S0,) * (3 + n_w), via=ExpertDispatch.ALL_TO_ALL))
    if experts > 1 and _partial_ok(ctx):
        opts.append(AxisOption(P, (R, R, R) + (S0,) * n_w))
    return opts


def experts_strategies(strategies: list, mesh_shape: Sequence[int], axis_roles: Sequence) -> list:
    """The strategies whose experts are split on at most one axis of more than one rank, by the
    all-to-all on an ``AxisRole.EXPERT`` axis."""
    from autopar.options import AxisRole

    out = []
    for s in strategies:
        split = [a for a, p in enumerate(s.ins[3]) if is_shard(p) and mesh_shape[a] > 1]
        if len(split) > 1:
            continue
        if any(
            r is AxisRole.EXPERT and n > 1 and s.via_axis(ExpertDispatch.ALL_TO_ALL) != a
            for a, (n, r) in enumerate(zip(mesh_shape, axis_roles))
        ):
            continue
        out.append(s)
    return out


def expert_weights(tg) -> frozenset[str]:
    """The names of the placeholders the MoE ops of ``tg`` read as experts' weights."""
    return frozenset(
        a.name
        for n in tg.graph.nodes
        if n.op == "call_function" and n.target is MOE
        for a in n.args[3:6]
        if hasattr(a, "op") and a.op == "placeholder"
    )


register(MOE)(experts_rule)
