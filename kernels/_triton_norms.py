"""Triton kernels of ``kernels/norms.py``: RMSNorm and LayerNorm over the last dim, with the residual
add fused in front, forward and backward.

One program per row in the forward (a block of ``next_power_of_2(N)`` columns, masked); in the
backward each program walks a contiguous group of rows and accumulates its partial weight (and bias)
gradient in fp32 registers, written to a ``[programs, N]`` buffer that torch sums. Everything is
computed in fp32; loads go through ``.to(tl.float32)`` and stores through
``.to(PTR.dtype.element_ty)`` (Triton's interpreter needs both for bf16). The backward recomputes
the row statistics from ``h`` (the row is loaded anyway), so nothing but ``h`` is saved.

Imported only when a Triton path runs (``kernels/dispatch.py``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_fwd(X, R, W, B, Y, H, N, eps, offset,
              HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
              RMS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    base = row * N
    x = tl.load(X + base + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(R + base + cols, mask=mask, other=0.0).to(tl.float32)
    h = x.to(H.dtype.element_ty)  # h rounded to its dtype, as eager ``x + residual``
    tl.store(H + base + cols, h, mask=mask)
    h = h.to(tl.float32)
    if RMS:
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
        n = h * rstd
    else:
        mean = tl.sum(h, axis=0) / N
        d = tl.where(mask, h - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(d * d, axis=0) / N + eps)
        n = d * rstd
    if HAS_W:
        n = n * (tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + offset)
    if HAS_B:
        n = n + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + base + cols, n.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd(DY, DHIN, H, W, DH, DW, DB, N, rows, rows_per_prog, eps, offset,
              HAS_DY: tl.constexpr, HAS_DHIN: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
              RMS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + offset if HAS_W else 1.0
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_prog  # int64 bounds: an int64 loop variable
    end = tl.minimum(start + rows_per_prog, rows)
    for row in range(start, end):
        base = row * N
        dh = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_DY:
            h = tl.load(H + base + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + base + cols, mask=mask, other=0.0).to(tl.float32)
            if RMS:
                rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
                n = h * rstd
            else:
                mean = tl.sum(h, axis=0) / N
                d = tl.where(mask, h - mean, 0.0)
                rstd = tl.rsqrt(tl.sum(d * d, axis=0) / N + eps)
                n = d * rstd
            g = dy * w
            if RMS:
                dh = rstd * (g - n * (tl.sum(g * n, axis=0) / N))
            else:
                dh = rstd * (g - tl.sum(g, axis=0) / N - n * (tl.sum(g * n, axis=0) / N))
            dw += dy * n
            db += dy
        if HAS_DHIN:
            dh += tl.load(DHIN + base + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DH + base + cols, dh.to(DH.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(DW + pid * N + cols, dw, mask=mask)
    if HAS_B:
        tl.store(DB + pid * N + cols, db, mask=mask)


def _warps(block: int) -> int:
    # one row per program: 8 warps for rows of 2048-8191 elements (Llama's 4096), as Liger's and
    # Triton's tutorial layer norms use; 16 warps there spread a row too thin
    return 4 if block < 2048 else 8 if block < 8192 else 16 if block < 32768 else 32


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(rows: int, device: torch.device) -> int:
    # enough programs to fill the GPU a few times over; few under the interpreter
    cap = 4 * _sms(device.index or 0) if device.type == "cuda" else 4
    return max(1, min(rows, cap))


def norm_forward(x, residual, weight, bias, eps, offset, rms, y_dtype):
    """``(y, h)`` for contiguous ``x`` (and ``residual``) of any shape, normed over the last dim."""
    n_cols = x.shape[-1]
    rows = x.numel() // max(n_cols, 1)
    h_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    h = torch.empty(x.shape, dtype=h_dtype, device=x.device)
    y = torch.empty(x.shape, dtype=y_dtype, device=x.device)
    if rows == 0 or n_cols == 0:
        return y, h
    block = triton.next_power_of_2(n_cols)
    _norm_fwd[(rows,)](
        x, residual if residual is not None else x, weight if weight is not None else x,
        bias if bias is not None else x, y, h, n_cols, eps, offset,
        HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None,
        RMS=rms, BLOCK=block, num_warps=_warps(block),
    )  # fmt: skip
    return y, h


def norm_backward(grad_y, grad_h, h, weight, has_bias, eps, offset, rms):
    """``(dh, dw, db)``: ``dh`` in ``h``'s dtype, ``dw``/``db`` fp32 (``None`` when absent)."""
    n_cols = h.shape[-1]
    rows = h.numel() // max(n_cols, 1)
    dh = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    programs = _programs(rows, h.device)
    dw = torch.zeros((programs, n_cols), dtype=torch.float32, device=h.device) if weight is not None else None
    db = torch.zeros((programs, n_cols), dtype=torch.float32, device=h.device) if has_bias else None
    if rows and n_cols:
        block = triton.next_power_of_2(n_cols)
        _norm_bwd[(programs,)](
            grad_y if grad_y is not None else h, grad_h if grad_h is not None else h, h,
            weight if weight is not None else h, dh, dw if dw is not None else h,
            db if db is not None else h, n_cols, rows, triton.cdiv(rows, programs), eps, offset,
            HAS_DY=grad_y is not None, HAS_DHIN=grad_h is not None, HAS_W=weight is not None,
            HAS_B=has_bias, RMS=rms, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return dh, dw.sum(0) if dw is not None else None, db.sum(0) if db is not None else None
