"""Local ops the generated code calls where a sharded op needs more than the aten op itself.

Each takes this rank's mesh coordinate as an argument (from ``collectives.coordinate``), so the
same function runs in the real module and in the single-process rule validator.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, coord: int, padding_idx: int = -1):
    """Lookup in this rank's rows ``[coord * V_local, (coord + 1) * V_local)`` of the table.

    Ids outside the range give zero rows: summed over the axis (Partial) every id finds its row
    exactly once (Megatron-LM's vocabulary-parallel embedding)."""
    rows = weight.shape[0]
    start = coord * rows
    outside = (ids < start) | (ids >= start + rows)
    local = (ids - start).masked_fill(outside, 0)
    pad = padding_idx - start if padding_idx is not None and start <= padding_idx < start + rows else -1
    out = torch.ops.aten.embedding.default(weight, local, pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def causal_attention_rows(q, k, v, coord: int, dropout_p: float = 0.0, scale=None, enable_gqa: bool = False):
    """Causal attention for this rank's block of query positions against all keys.

    ``q`` holds query rows ``[coord * L, (coord + 1) * L)`` of the sequence; ``k``/``v`` hold every
    position. ``is_causal`` would align the mask to the top-left corner of the local block, so the
    mask is built from the global positions instead."""
    rows, keys = q.shape[-2], k.shape[-2]
    q_pos = torch.arange(rows, device=q.device) + coord * rows
    mask = torch.arange(keys, device=q.device)[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa
    )


def arange_piece(start, step, length: int, coord: int, **kwargs) -> torch.Tensor:
    """This rank's block of ``arange(start, ..., step)``: elements ``[coord * length, (coord + 1) * length)``."""
    first = start + coord * length * step
    return (
        torch.arange(length, **kwargs) * step + first
        if step != 1
        else torch.arange(first, first + length, **kwargs)
    )


def local_rows(index: torch.Tensor, coord: int, rows: int) -> torch.Tensor:
    """Global row numbers of this rank's block ``[coord * rows, (coord + 1) * rows)`` as rows of the
    block itself."""
    return index - coord * rows


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast over ``x`` (channels on dim 1)."""
    return t.view((1, -1) + (1,) * (x.dim() - 2))


def channel_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over every dim but the channels (dim 1), in float32 at least."""
    acc = torch.promote_types(x.dtype, torch.float32)
    return x.sum(dim=[d for d in range(x.dim()) if d != 1], dtype=acc)


def channel_squared_deviations(x: torch.Tensor, total: torch.Tensor, count: int) -> torch.Tensor:
    """Per channel, the sum of ``(x - mean)^2`` over this rank's elements, ``mean = total / count``."""
    dev = x.to(total.dtype) - _per_channel(total / count, x)
    return (dev * dev).sum(dim=[d for d in range(x.dim()) if d != 1])


def batch_norm_of_sums(
    x, total, squares, count: int, weight, bias, running_mean, running_var, momentum, eps
) -> torch.Tensor:
    """Training batch norm from the whole batch's per-channel sum and squared deviations over
    ``count`` elements per channel; running statistics (if any) updated in place as
    ``torch.batch_norm`` does (the variance unbiased)."""
    mean, var = total / count, squares / count
    if running_mean is not None:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            unbiased = var * (count / max(count - 1, 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    y = (x.to(total.dtype) - _per_channel(mean, x)) * _per_channel(torch.rsqrt(var + eps), x)
    if weight is not None:
        y = y * _per_channel(weight, x)
    if bias is not None:
        y = y + _per_channel(bias, x)
    return y.to(x.dtype)


def loss_sum_and_count(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """This rank's cross-entropy sum and count of counted tokens, as one tensor ``[sum, count]``
    (one all-reduce sums both over the ranks). Summed in float32 at least: in float16 a sum or
    count past 65504 is inf, and a bfloat16 count is inexact above 256 tokens."""
    per_token = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="none")
    acc = torch.promote_types(per_token.dtype, torch.float32)
    count = (target != ignore_index).sum(dtype=acc)
    return torch.stack([per_token.sum(dtype=acc), count])


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused output projection + loss (``torch.ops.autopar.linear_cross_entropy``) on its
    operands as autocast casts a linear's (``kernels/cross_entropy.py:autocast_operands``)."""
    from autopar.kernels.cross_entropy import autocast_operands

    h, weight = autocast_operands(h, weight)
    return torch.ops.autopar.linear_cross_entropy(h, weight, target, ignore_index, reduction, chunk_rows)


def fused_loss_sum_and_count(
    h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int, chunk_rows: int, axes=()
) -> torch.Tensor:
    """``loss_sum_and_count`` of the output projection fused with its loss
    (``kernels/cross_entropy.py``): this rank's rows' loss sum, computed in chunks, never the
    logits; over the vocabulary split on ``axes`` (none: the whole vocabulary here) the vocabulary-
    parallel form (``collectives.vocab_parallel_cross_entropy``)."""
    if axes:
        from autopar.codegen.collectives import vocab_parallel_cross_entropy

        loss = vocab_parallel_cross_entropy(h, weight, target, ignore_index, "sum", chunk_rows, axes)
    else:
        loss = linear_cross_entropy(h, weight, target, ignore_index, "sum", chunk_rows)[0]
    count = (target != ignore_index).sum(dtype=loss.dtype)
    return torch.stack([loss, count])


def loss_alone(loss: torch.Tensor) -> tuple[torch.Tensor, None]:
    """A loss where the fused op returns ``(loss, per-row logsumexp)``: the graph reads only the
    loss, and a split op's rows' logsumexp is no whole value to return."""
    return loss, None


def label_count(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The count of counted tokens ``loss_sum_and_count`` pairs with its sum, in float32 (exact up
    to 2**24 tokens a rank), from the labels alone."""
    return (target != ignore_index).sum(dtype=torch.float32)


def mean_of_sum_and_count(pair: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mean loss from the all-reduced ``[sum, count]``, in the loss's dtype."""
    return (pair[0] / pair[1]).to(dtype)
