"""Triton kernels of ``kernels/cross_entropy.py``: one chunk's row-wise log-sum-exp and target logit
(forward), and a block of vocabulary's softmax-minus-one-hot gradient (backward).

Both read logits ``[rows, V]`` (forward: a chunk of rows over the vocabulary this rank holds, the
whole of it or a shard starting at global id ``vocab_start``; backward: every row over a block of
the vocabulary, its global ids ``vocab_start`` on), compute in fp32 and store in the output
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
    a_ptr,
    b_ptr,
    V,
    vocab_start,
    BLOCK_V: tl.constexpr,
):
    """Program (row, block): ``a * exp(x - lse) - b * onehot(label - vocab_start)`` on one block of
    the row's columns (``a``, ``b``: the row's fp32 coefficients; both 0 on an ignored row)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    x = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row).to(tl.float32)
    label = tl.load(labels_ptr + row)
    a = tl.load(a_ptr + row).to(tl.float32)
    b = tl.load(b_ptr + row).to(tl.float32)
    g = a * tl.exp(x - lse) - tl.where(cols == label - vocab_start, b, 0.0)
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
    coef_softmax: torch.Tensor,
    coef_onehot: torch.Tensor,
    vocab_start: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out[r] = a[r] * exp(logits[r] - lse[r]) - b[r] * onehot(labels[r] - vocab_start)``, with
    ``lse`` the given (global) log-sum-exp, so ``logits`` may be a block of the vocabulary's columns
    (global ids ``vocab_start`` on). ``out`` may be ``logits`` itself (in place: each element is
    read before it is written, by one program)."""
    rows, v = logits.shape
    if rows == 0 or v == 0:
        return out
    block = min(_block_v(v), 1024 if not interpreting() else MAX_BLOCK_V_INTERPRETED)
    _grad_kernel[(rows, triton.cdiv(v, block))](
        logits,
        logits.stride(0),
        out,
        out.stride(0),
        labels,
        lse,
        coef_softmax,
        coef_onehot,
        v,
        vocab_start,
        BLOCK_V=block,
        num_warps=_num_warps(block),
    )
    return out
