"""Triton kernels of ``kernels/cross_entropy.py``: one chunk's row-wise log-sum-exp and target logit
(forward), and its softmax-minus-one-hot gradient (backward).

Both read a chunk of fp32 logits ``[rows, V]`` (``V`` the vocabulary this rank holds: the whole of
it, or a shard starting at global id ``vocab_start``), compute in fp32 and store in the output
pointer's dtype. Imported only when a Triton path runs (``kernels/dispatch.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autopar.kernels.dispatch import interpreting

# vocabulary block one program loads at a time (a power of two). Under the interpreter (tests, on
# CPU) each program and each block costs Python overhead, so blocks are as wide as the row allows.
MAX_BLOCK_V = 4096
MAX_BLOCK_V_INTERPRETED = 1 << 16


def _block_v(v: int) -> int:
    cap = MAX_BLOCK_V_INTERPRETED if interpreting() else MAX_BLOCK_V
    return min(cap, triton.next_power_of_2(max(v, 16)))


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


@triton.jit
def _lse_target_kernel(
    logits_ptr,
    stride_row,
    labels_ptr,
    lse_ptr,
    target_ptr,
    V,
    vocab_start,
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    """One program per row: an online max / rescaled sum over the vocabulary in ``BLOCK_V`` blocks,
    so a row of any length (V = 128256) streams through registers once."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    label = tl.load(labels_ptr + row)
    local = label - vocab_start
    hit = (label != ignore_index) & (local >= 0) & (local < V)
    target = tl.load(base + tl.where(hit, local, 0), mask=hit, other=0.0).to(tl.float32)
    tl.store(lse_ptr + row, lse.to(lse_ptr.dtype.element_ty))
    tl.store(target_ptr + row, target.to(target_ptr.dtype.element_ty))


@triton.jit
def _grad_kernel(
    logits_ptr,
    stride_row,
    grad_ptr,
    stride_grad,
    labels_ptr,
    lse_ptr,
    scale_ptr,
    V,
    vocab_start,
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    """Program (row, block): ``scale * (exp(x - lse) - onehot(label))`` on one vocabulary block;
    zero on a row whose label is ``ignore_index`` (even where ``scale`` is inf: mean of none)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    x = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row).to(tl.float32)
    label = tl.load(labels_ptr + row)
    scale = tl.load(scale_ptr).to(tl.float32)
    g = tl.exp(x - lse) - tl.where(cols == label - vocab_start, 1.0, 0.0)
    g = tl.where(label != ignore_index, g * scale, 0.0)
    tl.store(grad_ptr + row * stride_grad + cols, g.to(grad_ptr.dtype.element_ty), mask=mask)


def lse_target(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``logits`` (fp32 ``[rows, V]``, unit stride along V): (log-sum-exp, the logit of
    the row's label where it lies in ``[vocab_start, vocab_start + V)`` and is not ignored, else 0)."""
    rows, v = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    target = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return lse, target
    block = _block_v(v)
    _lse_target_kernel[(rows,)](
        logits,
        logits.stride(0),
        labels,
        lse,
        target,
        v,
        vocab_start,
        ignore_index,
        BLOCK_V=block,
        num_warps=_num_warps(block),
    )
    return lse, target


def softmax_grad(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    vocab_start: int,
    ignore_index: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out[r] = scale * (softmax(logits[r]) - onehot(labels[r] - vocab_start))``, zero on ignored
    rows; ``softmax`` through the given ``lse`` (the global one, for a vocabulary shard). ``out`` may
    be ``logits`` itself (in place: each element is read before it is written, by one program)."""
    rows, v = logits.shape
    if rows == 0:
        return out
    block = min(_block_v(v), 1024 if not interpreting() else MAX_BLOCK_V_INTERPRETED)
    _grad_kernel[(rows, triton.cdiv(v, block))](
        logits,
        logits.stride(0),
        out,
        out.stride(0),
        labels,
        lse,
        scale,
        v,
        vocab_start,
        ignore_index,
        BLOCK_V=block,
        num_warps=_num_warps(block),
    )
    return out
