"""Ring attention: attention whose queries, keys and values all stay split on the sequence.

Each rank of a mesh axis holds a contiguous block of the sequence's queries, keys and values
(``Shard`` on the sequence dim). Key/value blocks travel around the ring of the axis's ranks: at
step ``i`` rank ``r`` holds block ``j = (r - i) mod n``, computes its queries against it, and
merges the block's partial result into its running one with an online softmax (the running
log-sum-exp of each query row: Milakov & Gimelshein 2018; Liu et al. 2023, "Ring Attention").
The send of the next block is started before the current block's compute and waited for after it,
so communication overlaps compute where the backend runs it asynchronously (NCCL; gloo's worker
threads). No rank ever holds more than two key/value blocks: memory does not grow with the whole
sequence, unlike gathering K and V.

Backward runs the ring again: each key/value block travels with its gradient accumulators, every
rank adds the gradient its queries contribute, and after ``n`` hops the accumulators are back at
the block's owner. Query gradients stay local. Causal attention on contiguous blocks skips the
blocks after the rank's own (all masked) and masks the diagonal block; that leaves the ranks
unbalanced (the last computes ``n`` blocks, the first one). A zig-zag layout would balance it but
changes what ``Shard`` means for every other op of the graph, so it is left out (the cost model
prices the slowest rank).

Why written here and not ``torch.distributed.tensor.experimental.context_parallel``: torch's ring
runs when ``F.scaled_dot_product_attention`` is called on sequence-sharded DTensors, while the
generated graph computes on local tensors; its local-tensor entry points are private and differ
between the torch versions autopar supports; and it takes no attention mask (padding) and no
grouped K/V heads. Here the block math is plain torch (any device and dtype, float64 in the rule
validator), computed in float32 at least.

The communication is a ``Transport`` so that the same forward and backward run in a real process
group (``P2PRing``: ``batch_isend_irecv`` to the next rank, from the previous) and in the
single-process rule validator (``autopar/tools/simulate.py``, which runs every rank in a thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from autopar.codegen.collectives import axis_group, current_mesh


class Pending(Protocol):
    def wait(self) -> list[torch.Tensor]: ...


class Transport(Protocol):
    """Sends tensors to the next rank of the ring and receives the previous rank's."""

    def start(self, tensors: Sequence[torch.Tensor]) -> Pending: ...


class _P2PPending:
    def __init__(self, reqs, send: torch.Tensor, recv: torch.Tensor, like: Sequence[torch.Tensor]):
        # the send buffer is held until the hop is done: the backend reads it in the background
        self.reqs, self.send, self.recv, self.like = reqs, send, recv, like

    def wait(self) -> list[torch.Tensor]:
        for r in self.reqs:
            r.wait()
        self.send = None
        out, at = [], 0
        for t in self.like:
            out.append(self.recv[at : at + t.numel()].view(t.shape))
            at += t.numel()
        return out


class P2PRing:
    """The ring of one mesh axis's process group: one flat buffer per hop, sent to coordinate
    ``r + 1`` and received from ``r - 1`` with ``batch_isend_irecv`` (NCCL and gloo)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, n: int):
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % n)
        self.prev = dist.get_global_rank(group, (rank - 1) % n)

    def start(self, tensors: Sequence[torch.Tensor]) -> Pending:
        dtype = tensors[0].dtype
        flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
        recv = torch.empty_like(flat)
        ops = [
            dist.P2POp(dist.isend, flat, self.next, self.group),
            dist.P2POp(dist.irecv, recv, self.prev, self.group),
        ]
        return _P2PPending(dist.batch_isend_irecv(ops), flat, recv, tensors)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# the most bytes one block's float32 scores may take at once: query rows are taken in chunks
# under it, so a long sequence's block (16k x 16k keys, 32 heads: 32 GiB) never materializes
SCORE_BYTES = 2**28


def _row_chunks(q: torch.Tensor, keys: int):
    """Slices of ``q``'s rows whose scores against ``keys`` keys stay under ``SCORE_BYTES``."""
    rows = q.shape[-2]
    per_row = max(1, q[..., :1, :1].numel() * keys * 4)
    step = max(1, min(rows, SCORE_BYTES // per_row))
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


def _scores(q, k, scale, mask, diagonal_causal: bool, row0: int = 0) -> torch.Tensor:
    """``q k^T * scale`` of one block's query rows ``row0...`` (accumulation dtype), masked
    entries at -inf (``mask``: those rows' mask, or one row that every row shares)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(s.dtype)
    if diagonal_causal:
        rows, cols = s.shape[-2], s.shape[-1]
        upper = torch.ones(rows, cols, dtype=torch.bool, device=s.device).triu(row0 + 1)
        s = s.masked_fill(upper, float("-inf"))
    return s


def _mask_rows(mask: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    if mask is None or mask.dim() < 2 or mask.shape[-2] == 1:
        return mask
    return mask[..., rows, :]


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(s - lse)``, zero on rows where every score is masked."""
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.nan_to_num(p, nan=0.0)


def _expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _reduce_heads(g: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return g
    b, h, s, e = g.shape
    return g.view(b, h // groups, groups, s, e).sum(2)


def _mask_block(mask: torch.Tensor | None, j: int, block: int) -> torch.Tensor | None:
    if mask is None or mask.shape[-1] == 1:
        return mask
    return mask[..., j * block : (j + 1) * block]


def _step_kind(r: int, j: int, causal: bool) -> str:
    """What rank ``r`` does with key block ``j``: skip it (all masked), the diagonal, or all of it."""
    if not causal or j < r:
        return "full"
    return "diagonal" if j == r else "skip"


def ring_forward(q, k, v, mask, rank: int, n: int, causal: bool, scale: float, ring: Transport):
    """This rank's attention output (``q``'s dtype) and its rows' log-sum-exp (accumulation dtype)."""
    acc = _acc_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    qa = q.to(acc)
    # the values' head dim, which may differ from the queries' (DeepSeek-V3's MLA: 128 against 192)
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    kv = [k, v]
    block = k.shape[2]
    for i in range(n):
        pending = ring.start(kv) if i < n - 1 else None
        j = (rank - i) % n
        kind = _step_kind(rank, j, causal)
        if kind != "skip":
            kb, vb = (_expand_heads(t.to(acc), groups) for t in kv)
            mb = _mask_block(mask, j, block)
            for rows in _row_chunks(qa, block):
                s = _scores(qa[..., rows, :], kb, scale, _mask_rows(mb, rows), kind == "diagonal", rows.start)
                lse_b = torch.logsumexp(s, dim=-1)
                out_b = torch.matmul(_probs(s, lse_b), vb)
                old = lse[..., rows]
                new = torch.logaddexp(old, lse_b)
                w_old = torch.nan_to_num(torch.exp(old - new), nan=0.0).unsqueeze(-1)
                w_new = torch.nan_to_num(torch.exp(lse_b - new), nan=0.0).unsqueeze(-1)
                out[..., rows, :] = out[..., rows, :] * w_old + out_b * w_new
                lse[..., rows] = new
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse


def ring_backward(
    dout, q, k, v, mask, out, lse, rank: int, n: int, causal: bool, scale: float, ring: Transport, mask_grad=False
):  # fmt: skip
    """Gradients of ``q``, ``k``, ``v`` and (``mask_grad``: an additive float mask that needs one)
    the mask, in their dtypes, else None for it.

    At step ``i`` this rank computes the gradient its queries give key block ``j = (r - i) mod n``,
    adds it to the block's accumulators (which arrive from the previous rank, sent at its step
    ``i - 1``) and sends them on: each block's accumulators visit every rank and, after ``n``
    hops, are back at its owner. Both sends overlap the next step's compute. Query gradients, and
    the mask's (this rank's rows), stay here."""
    acc = _acc_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    qa, da = q.to(acc), dout.to(acc)
    rowdot = (da * out.to(acc)).sum(-1, keepdim=True)  # D = rowsum(dO * O)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = [k, v]
    block = k.shape[2]
    dmask = torch.zeros(mask.shape, dtype=acc, device=mask.device) if mask_grad else None
    sent: Pending | None = None  # the accumulators sent at the previous step
    for i in range(n):
        pending = ring.start(kv) if i < n - 1 else None
        j = (rank - i) % n
        kind = _step_kind(rank, j, causal)
        dkb = torch.zeros(kv[0].shape, dtype=acc, device=q.device)
        dvb = torch.zeros(kv[1].shape, dtype=acc, device=q.device)
        if kind != "skip":
            kb, vb = (_expand_heads(t.to(acc), groups) for t in kv)
            mb = _mask_block(mask, j, block)
            dk_full, dv_full = torch.zeros_like(kb), torch.zeros_like(vb)
            for rows in _row_chunks(qa, block):
                mr = _mask_rows(mb, rows)
                s = _scores(qa[..., rows, :], kb, scale, mr, kind == "diagonal", rows.start)
                p = _probs(s, lse[..., rows])
                d_rows = da[..., rows, :]
                dv_full += torch.matmul(p.transpose(-1, -2), d_rows)
                ds = p * (torch.matmul(d_rows, vb.transpose(-1, -2)) - rowdot[..., rows, :])
                dq[..., rows, :] += torch.matmul(ds, kb) * scale
                dk_full += torch.matmul(ds.transpose(-1, -2), qa[..., rows, :]) * scale
                if dmask is not None:  # an additive mask's gradient is the scores'
                    cols = slice(None) if mask.shape[-1] == 1 else slice(j * block, (j + 1) * block)
                    target = dmask[..., cols] if mr is mb else dmask[..., rows, cols]
                    target += ds.sum_to_size(target.shape)
            dkb, dvb = _reduce_heads(dk_full, groups), _reduce_heads(dv_full, groups)
        if sent is not None:
            arrived = sent.wait()
            dkb, dvb = dkb + arrived[0], dvb + arrived[1]
        sent = ring.start([dkb, dvb])
        if pending is not None:
            kv = pending.wait()
    dk, dv = sent.wait()
    dm = dmask.to(mask.dtype) if dmask is not None else None
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dm


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, axis, causal, scale, mesh):
        n, r = mesh.size(axis), mesh.get_local_rank(axis)
        ring = P2PRing(axis_group(mesh, axis), r, n)
        k, v = k.contiguous(), v.contiguous()
        out, lse = ring_forward(q, k, v, mask, r, n, causal, scale, ring)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.axis, ctx.causal, ctx.scale, ctx.mesh = axis, causal, scale, mesh
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, out, lse = ctx.saved_tensors
        mesh, axis = ctx.mesh, ctx.axis
        n, r = mesh.size(axis), mesh.get_local_rank(axis)
        ring = P2PRing(axis_group(mesh, axis), r, n)
        mask_grad = ctx.needs_input_grad[3]
        dq, dk, dv, dm = ring_backward(
            dout.contiguous(), q, k, v, mask, out, lse, r, n, ctx.causal, ctx.scale, ring, mask_grad
        )
        return dq, dk, dv, dm, None, None, None, None


def attention_scale(q: torch.Tensor, scale: float | None) -> float:
    """SDPA's default scale, ``1 / sqrt(head dim)``, where none is given."""
    return scale if scale is not None else q.shape[-1] ** -0.5


def ring_attention(q, k, v, mask, axis: int, causal: bool, scale: float | None = None) -> torch.Tensor:
    """What the generated code calls for ``scaled_dot_product_attention`` under ``SeqAttention.RING``
    on mesh axis ``axis``: ``q`` ``[B, H, L/n, E]``, ``k`` and ``v`` ``[B, H_kv, L/n, E]`` (``H``
    a multiple of ``H_kv``: grouped heads), ``mask`` this rank's query rows of the mask (every
    key column) or None."""
    return _RingAttention.apply(q, k, v, mask, axis, causal, attention_scale(q, scale), current_mesh())


__all__ = ["P2PRing", "Transport", "attention_scale", "ring_attention", "ring_backward", "ring_forward"]
