"""Attention with its query rows split on the sequence over a mesh axis ``a`` of ``n`` ranks.

``ring_attention`` (``SeqAttention.RING``, ``codegen/context_parallel.py``): Q, K and V stay split.
Forward sends the local K/V block ``n - 1`` hops around the ring (one point-to-point hop each:
``k`` and ``v`` flattened into one buffer of K's dtype), each behind one block's compute, a third of
the op's time over ``n`` blocks (the slowest rank computes every block, causal or not). Backward
sends K/V ``n - 1`` hops and the K/V gradient accumulators (float32 at least) ``n`` hops: hop ``i``
of each travels behind block ``i``'s backward (the other two thirds over ``n``), the last
accumulator hop behind nothing.

``sequence_all_to_all`` (``SeqAttention.ALL_TO_ALL``, DeepSpeed-Ulysses,
``codegen/lower.py:_lower_ulysses``): Q, K and V re-cut from sequence to heads by one all-to-all
each (a single K/V head is all-gathered instead, its gradient reduce-scattered: the gathered
bytes), the output re-cut back; backward the same calls the other way. None hidden.

``causal_attention_rows`` (no ``via``, causal, rows split): each rank's query rows against the
whole K and V (gathered by reshards), with a mask built from global positions (``[rows, keys]``,
``codegen/local_ops.py:causal_attention_rows``) that SDPA turns into an additive mask of the
queries' dtype and keeps for backward: its bytes are what this lowering saves. No collective.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.lowerings import Collective, Lowering, LoweringCall, LoweringPlan, Phase, register
from autopar.placement import SeqAttention, is_shard, volume_factor

SDPA = torch.ops.aten.scaled_dot_product_attention.default
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def query_rows_axis(node: fx.Node, s, mesh_shape) -> int | None:
    """The mesh axis of more than one rank that splits SDPA's query rows under ``s``, if any."""
    seq = len(node.args[0].meta["val"].shape) - 2
    for a, p in enumerate(s.ins[0]):
        if is_shard(p) and p.dim == seq:
            return a if mesh_shape[a] > 1 else None
    return None


def is_causal(node: fx.Node) -> bool:
    return bool(node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False))


def _bytes(t: torch.Tensor, spec, mesh_shape) -> float:
    return t.numel() * t.element_size() / volume_factor(spec, mesh_shape)


def _ring(node: fx.Node, s, mesh_shape: tuple[int, ...]) -> LoweringPlan | None:
    a = query_rows_axis(node, s, mesh_shape)
    if a is None or s.via_axis(SeqAttention.RING) != a:
        return None
    n = mesh_shape[a]
    k, v = node.args[1].meta["val"], node.args[2].meta["val"]
    kv = (k.numel() + v.numel()) * k.element_size() / volume_factor(s.ins[1], mesh_shape)
    grads = kv / k.element_size() * torch.promote_types(k.dtype, torch.float32).itemsize
    hop = Collective.SEND_RECV
    # K and V travel in the dtype attention runs in (op_dtype), the accumulated gradients in fp32
    calls = [LoweringCall(hop, a, kv, Phase.FORWARD, i, 1 / (3 * n), op_dtype=True) for i in range(n - 1)]
    for i in range(n):
        w = n - 1 + i if i < n - 1 else None  # the last accumulator hop hides behind nothing
        hides = 2 / (3 * n) if w is not None else 0.0
        if i < n - 1:
            calls.append(LoweringCall(hop, a, kv, Phase.BACKWARD, w, hides, op_dtype=True))
        calls.append(LoweringCall(hop, a, grads, Phase.BACKWARD, w, hides))
    return LoweringPlan(tuple(calls))


def _all_to_all(node: fx.Node, s, mesh_shape: tuple[int, ...]) -> LoweringPlan | None:
    a = query_rows_axis(node, s, mesh_shape)
    if a is None or s.via_axis(SeqAttention.ALL_TO_ALL) != a:
        return None
    q, k, v = (x.meta["val"] for x in node.args[:3])
    out = node.meta["val"]
    one_kv_head = k.shape[1] == 1
    calls = []
    a2a = Collective.ALL_TO_ALL
    for phase in (Phase.FORWARD, Phase.BACKWARD):  # every tensor in the dtype attention runs in
        calls.append(LoweringCall(a2a, a, _bytes(q, s.ins[0], mesh_shape), phase, op_dtype=True))
        for t, spec in ((k, s.ins[1]), (v, s.ins[2])):
            if one_kv_head:
                kind = Collective.ALL_GATHER if phase is Phase.FORWARD else Collective.REDUCE_SCATTER
                nbytes = _bytes(t, spec, mesh_shape) * mesh_shape[a]
                calls.append(LoweringCall(kind, a, nbytes, phase, op_dtype=True))
            else:
                calls.append(LoweringCall(a2a, a, _bytes(t, spec, mesh_shape), phase, op_dtype=True))
        calls.append(LoweringCall(a2a, a, _bytes(out, s.out, mesh_shape), phase, op_dtype=True))
    return LoweringPlan(tuple(calls))


def _causal_rows(node: fx.Node, s, mesh_shape: tuple[int, ...]) -> LoweringPlan | None:
    a = query_rows_axis(node, s, mesh_shape)
    if a is None or any(s.via) or not is_causal(node):
        return None
    q, k = node.args[0].meta["val"], node.args[1].meta["val"]
    return LoweringPlan(saved_bytes=q.shape[-2] // mesh_shape[a] * k.shape[-2] * q.element_size())


RING = register(Lowering("ring_attention", (SDPA,), _ring))
ALL_TO_ALL = register(Lowering("sequence_all_to_all", (SDPA,), _all_to_all))
CAUSAL_ROWS = register(Lowering("causal_attention_rows", (SDPA,), _causal_rows))
