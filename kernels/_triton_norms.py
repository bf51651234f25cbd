"""Triton kernels of ``kernels/norms.py``: RMSNorm and LayerNorm over the last dim, with the residual
add fused in front, forward and backward.

Forward: one program per row (a block of ``next_power_of_2(N)`` columns, masked). Backward: two
kernels, both streaming at memory bandwidth rather than walking rows serially:

1. ``_norm_bwd_dh``: one program per row, as the forward, with no accumulators. It recomputes the
   row's statistics from ``h`` (the row is loaded anyway, so nothing but ``h`` is saved), writes
   ``dh`` (plus the incoming gradient of ``h``) in ``h``'s dtype, and the row's ``rstd`` (and
   ``mean`` for LayerNorm) to fp32 ``[rows]`` buffers when a weight or bias gradient is needed.
2. ``_norm_bwd_dwdb``: a column-blocked reduction over rows. Program ``(c, g)`` owns ``BLOCK_N``
   columns and a group of rows, reads ``[BLOCK_M, BLOCK_N]`` tiles of ``dy`` and ``h`` with the
   per-row statistics, accumulates ``sum(dy * n)`` (and ``sum(dy)``) in fp32 and writes its partial
   to row ``g`` of a ``[groups, N]`` fp32 buffer that torch sums (deterministic: no atomics).
   ``n`` is ``h * rstd`` or ``(h - mean) * rstd``; the weight gradient is ``sum(dy * n)`` whatever
   the weight offset (d/dw of ``(w + offset) * n`` is ``n``).

Why not one kernel: a single-kernel backward keeping ``[BLOCK]`` fp32 dw/db accumulators in
registers across ~16 rows per program spills at 8 warps, and each program is latency bound
(~0.4 TB/s; measured 0.6-0.76 ms at 8192x4096 bf16 on an H100 against ~0.32 ms for PyTorch's
LayerNorm backward).

Traffic at 8192 x 4096 bf16 (64 MiB = 67.1 MB a tensor), at ~2.5 TB/s on an H100:

- ``_norm_bwd_dh``: reads ``dy``, ``h`` and ``dhin`` (the residual stream's gradient), writes
  ``dh``: 4 x 67.1 = 268 MB (+ 64/128 KB of statistics), ~0.107 ms; 201 MB, ~0.080 ms without
  ``dhin``.
- ``_norm_bwd_dwdb``: reads ``dy`` and ``h`` again: 134 MB, ~0.054 ms; its partials are
  ``groups x N`` fp32 (16 x 4096 x 4 B = 256 KB with 132 SMs), summed by torch in microseconds.

So ~0.16 ms for the backward (~0.3 ms forward and backward) where the fused single kernel took
0.6-0.76 ms. (Fusing dw into the dh kernel would save the second read of ``dy`` and ``h``, 134 MB,
but brings back the register accumulators or atomics.)

Everything is computed in fp32; loads go through ``.to(tl.float32)`` and stores through
``.to(PTR.dtype.element_ty)`` (Triton's interpreter needs both for bf16).

Imported only when a Triton path runs (``kernels/dispatch.py``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _normalized(h, mask, N, eps, RMS: tl.constexpr):
    """A row ``h`` (fp32, 0 past ``mask``) normalized, with its mean (0 for RMS) and ``rstd``:
    ``h * rstd`` or ``(h - mean) * rstd``, as the forward and the backward both compute them."""
    if RMS:
        mean = 0.0
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
        n = h * rstd
    else:
        mean = tl.sum(h, axis=0) / N
        d = tl.where(mask, h - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(d * d, axis=0) / N + eps)
        n = d * rstd
    return n, mean, rstd


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
    n, _, _ = _normalized(h.to(tl.float32), mask, N, eps, RMS)
    if HAS_W:
        n = n * (tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + offset)
    if HAS_B:
        n = n + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + base + cols, n.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_dh(DY, DHIN, H, W, DH, MEAN, RSTD, N, eps, offset,
                 HAS_DY: tl.constexpr, HAS_DHIN: tl.constexpr, HAS_W: tl.constexpr,
                 STATS: tl.constexpr, RMS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # one program per row, as the forward: dh only, no accumulators; the row's rstd (and mean)
    # go to fp32 [rows] buffers for the dw/db kernel when STATS
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    base = row * N
    dh = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_DY:
        h = tl.load(H + base + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + base + cols, mask=mask, other=0.0).to(tl.float32)
        n, mean, rstd = _normalized(h, mask, N, eps, RMS)
        if HAS_W:
            g = dy * (tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + offset)
        else:
            g = dy
        if RMS:
            dh = rstd * (g - n * (tl.sum(g * n, axis=0) / N))
        else:
            dh = rstd * (g - tl.sum(g, axis=0) / N - n * (tl.sum(g * n, axis=0) / N))
        if STATS:
            tl.store(RSTD + row, rstd)
            if not RMS:
                tl.store(MEAN + row, mean)
    if HAS_DHIN:
        dh += tl.load(DHIN + base + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(DH + base + cols, dh.to(DH.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_dwdb(DY, H, MEAN, RSTD, DW, DB, rows, N, rows_per_group,
                   HAS_W: tl.constexpr, HAS_B: tl.constexpr, RMS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    # program (c, g): columns [c * BLOCK_N, +BLOCK_N) over rows [g * rows_per_group, +rows_per_group),
    # in [BLOCK_M, BLOCK_N] tiles; its partial sums go to row g of the [groups, N] fp32 buffers
    pid_n = tl.program_id(0)
    group = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    start = group.to(tl.int64) * rows_per_group  # int64 offsets: an int64 loop variable
    end = tl.minimum(start + rows_per_group, rows)
    dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r in range(start, end, BLOCK_M):
        rws = r + tl.arange(0, BLOCK_M)
        rmask = rws < end
        offs = rws[:, None] * N + cols[None, :]
        mask = rmask[:, None] & cmask[None, :]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            h = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rws, mask=rmask, other=0.0)
            if RMS:
                n = h * rstd[:, None]
            else:
                n = (h - tl.load(MEAN + rws, mask=rmask, other=0.0)[:, None]) * rstd[:, None]
            dw += dy * n
        if HAS_B:
            db += dy
    if HAS_W:
        tl.store(DW + group * N + cols, tl.sum(dw, axis=0), mask=cmask)
    if HAS_B:
        tl.store(DB + group * N + cols, tl.sum(db, axis=0), mask=cmask)


def _warps(block: int) -> int:
    # one row per program: 8 warps for rows of 2048-8191 elements (Llama's 4096), as Liger's and
    # Triton's tutorial layer norms use; 16 warps there spread a row too thin
    return 4 if block < 2048 else 8 if block < 8192 else 16 if block < 32768 else 32


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _dwdb_grid(rows: int, n_cols: int, device: torch.device) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, groups, rows_per_group)`` of the dw/db reduction: ``cdiv(N, BLOCK_N) x
    groups`` programs, about 4 per SM on a GPU; under the interpreter (CPU tensors) small tiles and
    at most 2 groups, so a test's few rows still take several tiles, groups and column blocks."""
    if device.type == "cuda":
        block_m, block_n = 32, min(128, triton.next_power_of_2(n_cols))
        max_groups = triton.cdiv(4 * _sms(device.index or 0), triton.cdiv(n_cols, block_n))
    else:
        block_m, block_n, max_groups = 4, min(32, triton.next_power_of_2(n_cols)), 2
    groups = max(1, min(triton.cdiv(rows, block_m), max_groups))
    per_group = triton.cdiv(triton.cdiv(rows, groups), block_m) * block_m  # whole tiles per group
    return block_m, block_n, triton.cdiv(rows, per_group), per_group


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
    dev = h.device
    dh = torch.empty(h.shape, dtype=h.dtype, device=dev)
    has_w = weight is not None
    zeros = lambda: torch.zeros(n_cols, dtype=torch.float32, device=dev)  # noqa: E731
    dw = zeros() if has_w else None
    db = zeros() if has_bias else None
    if rows == 0 or n_cols == 0:
        return dh, dw, db
    stats = grad_y is not None and (has_w or has_bias)
    rstd = torch.empty(rows, dtype=torch.float32, device=dev) if stats else None
    mean = torch.empty(rows, dtype=torch.float32, device=dev) if stats and not rms else None
    block = triton.next_power_of_2(n_cols)
    _norm_bwd_dh[(rows,)](
        grad_y if grad_y is not None else h, grad_h if grad_h is not None else h, h,
        weight if has_w else h, dh, mean if mean is not None else h, rstd if stats else h,
        n_cols, eps, offset,
        HAS_DY=grad_y is not None, HAS_DHIN=grad_h is not None, HAS_W=has_w, STATS=stats, RMS=rms,
        BLOCK=block, num_warps=_warps(block),
    )  # fmt: skip
    if stats:  # with no grad_y, dw and db are zeros
        block_m, block_n, groups, per_group = _dwdb_grid(rows, n_cols, dev)
        part = lambda: torch.empty((groups, n_cols), dtype=torch.float32, device=dev)  # noqa: E731
        dw_part = part() if has_w else None
        db_part = part() if has_bias else None
        _norm_bwd_dwdb[(triton.cdiv(n_cols, block_n), groups)](
            grad_y, h, mean if mean is not None else rstd, rstd,
            dw_part if has_w else rstd, db_part if has_bias else rstd, rows, n_cols, per_group,
            HAS_W=has_w, HAS_B=has_bias, RMS=rms, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
        )  # fmt: skip
        dw = dw_part.sum(0) if has_w else None
        db = db_part.sum(0) if has_bias else None
    return dh, dw, db
