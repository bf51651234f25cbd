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
* **expert parallel once per node** (``ExpertDispatch.NODE_ALL_TO_ALL``): the same placements,
  each token sent once per node that holds any of its experts, then inside the node
  (``codegen/experts_nodes.py``); offered where the op is marked with the cluster's devices per
  node (``passes/experts.py:mark_nodes``) and kept where the axis's group spans whole nodes.
* **local experts**: tokens whole, experts split on ``E``: each rank runs the pairs routed to the
  experts it holds and leaves the others out: its output is a summand (Partial) of the layer's.
* **expert tensor parallel** (Megatron-Core's ETP): tokens whole, every expert's MLP split on its
  intermediate dim ``I``: ``w_in`` (and ``w_up``) on their ``F`` dim (Megatron's column split),
  ``w_out`` on its ``I`` dim (row split). Rank ``r`` computes ``act(x w_in[:, F_r]) (* x w_up[:, F_r])
  w_out[I_r, :]``, the term of the sum over ``I`` of its block: its output is a summand (Partial).
  That is the op itself on the local shards (its operands' shapes stay consistent: ``F_r = I_r``),
  so it needs no lowering and issues nothing inside: the Partial output is reduced by the reshard
  that reads it, and the Replicate inputs' gradients by their "f", both priced as reshards; the
  work divides by the axis (``Strategy.work_divisor``). A packed ``[.., 2I, ..]`` gate-up stack
  (Hugging Face's Mixtral, Qwen-MoE, DeepSeek-V3 ``gate_up_proj``) is split on its ``2I`` dim the
  same way, its pieces each a gate block and the matching up block: the module stores that weight
  permuted so that a plain ``Shard`` cuts such pieces (``autopar/lowerings/experts.py:
  PackedSplit``). Its pieces are whole halves wherever the option applies: ``w_out``'s ``I`` dim
  is split on the same axis, and splits only evenly.

With ``E`` split on one axis and ``I`` on another, each rank holds one block of ``I`` of its
experts: expert parallel over the first axis by all-to-all (tokens whole on the second), each
expert's output a summand over the second (EP x ETP).

Experts split on ``E`` on at most one axis of more than one rank, and by the all-to-all only there
(``experts_strategies``): the dispatch runs over one axis's group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import Shard

from autopar.kernels import moe  # noqa: F401  (registers autopar::moe_experts)
from autopar.lowerings.experts import NODES_META
from autopar.passes.rules import AxisOption, OpCtx, P, R, _partial_ok, register
from autopar.placement import ExpertDispatch
from autopar.reshard import expert_nodes

S0 = Shard(0)
MOE = torch.ops.autopar.moe_experts.default


def intermediate_dims(ctx: OpCtx) -> tuple[int, ...]:
    """The dim of each expert weight (``w_in``, ``w_up`` where given, ``w_out``) that holds the
    experts' intermediate size ``I`` (``2I`` for a packed gate-up ``w_in``): what expert tensor
    parallelism splits."""
    separate_up = ctx.n_in == 6
    f_dim, i_dim = (1, 2) if ctx.arg(8, "transposed") else (2, 1)
    return (f_dim,) * (2 if separate_up else 1) + (i_dim,)


def _storable(ctx: OpCtx) -> bool:
    """Whether a split of ``w_in``'s intermediate dim can run: always for separate gate and up (or
    no gate); for a packed gate-up ``w_in`` only where it is a parameter this op alone reads, which
    the module can keep permuted (``PackedSplit``)."""
    if not ctx.arg(7, "gated") or ctx.n_in == 6:
        return True
    w = ctx.node.args[3]
    return getattr(w, "op", None) == "placeholder" and len(w.users) == 1


def experts_rule(ctx: OpCtx) -> list[AxisOption]:
    tokens, experts = ctx.in_shapes[0][0], ctx.in_shapes[3][0]
    n_w = ctx.n_in - 3
    opts = []
    if tokens > 1:
        opts.append(AxisOption(S0, (S0, S0, S0) + (R,) * n_w))
        if experts > 1:
            opts.append(AxisOption(S0, (S0,) * (3 + n_w), via=ExpertDispatch.ALL_TO_ALL))
            if ctx.node.meta.get(NODES_META) is not None:
                # the same split, dispatched once per node, for a cluster of nodes: kept where the
                # axis spans them (experts_strategies)
                opts.append(AxisOption(S0, (S0,) * (3 + n_w), via=ExpertDispatch.NODE_ALL_TO_ALL))
    if experts > 1 and _partial_ok(ctx):
        opts.append(AxisOption(P, (R, R, R) + (S0,) * n_w))
    dims = intermediate_dims(ctx)
    if ctx.in_shapes[-1][dims[-1]] > 1 and _partial_ok(ctx) and _storable(ctx):
        opts.append(AxisOption(P, (R, R, R) + tuple(Shard(d) for d in dims)))  # expert tensor parallel
    return opts


def dispatch_axis(s) -> int | None:
    """The axis whose all-to-all (flat or once per node) dispatches the tokens under ``s``."""
    a = s.via_axis(ExpertDispatch.ALL_TO_ALL)
    return a if a is not None else s.via_axis(ExpertDispatch.NODE_ALL_TO_ALL)


def experts_strategies(
    strategies: list, mesh_shape: Sequence[int], axis_roles: Sequence, devices_per_node: int | None = None
) -> list:
    """The strategies whose experts are split (on ``E``) on at most one axis of more than one rank,
    by the all-to-all on an ``AxisRole.EXPERT`` axis. A split of each expert's intermediate dim
    (expert tensor parallelism) may go with it on another axis. The dispatch once per node only
    where its axis's group spans whole nodes of ``devices_per_node`` (None: not known, none)."""
    from autopar.options import AxisRole

    out = []
    for s in strategies:
        split = [a for a, p in enumerate(s.ins[3]) if p == S0 and mesh_shape[a] > 1]
        if len(split) > 1:
            continue
        if any(
            r is AxisRole.EXPERT and n > 1 and dispatch_axis(s) != a
            for a, (n, r) in enumerate(zip(mesh_shape, axis_roles))
        ):
            continue
        nodes = s.via_axis(ExpertDispatch.NODE_ALL_TO_ALL)
        if nodes is not None and (
            devices_per_node is None or expert_nodes(mesh_shape, nodes, devices_per_node) is None
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
