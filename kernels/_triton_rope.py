"""Triton kernel of ``kernels/rope.py``: rotary position embedding, forward and backward.

``x`` (or the incoming gradient) is viewed as ``[L0, L1, L2, D]`` (leading dims merged, ``_as4d``)
and its ``L0 L1 L2`` rows are cut into tiles of ``ROWS`` rows: a program handles ``ROWS`` x
``BLOCK`` of each half of the last dim (``BLOCK = next_power_of_2(D / 2)``, ``ROWS`` so a tile holds
~``TILE`` = 4096 elements of ``x``), both dims masked. ``x`` is read through its strides, so a
transposed ``[B, S, H, D] -> [B, H, S, D]`` input needs no copy; ``cos`` and ``sin`` are broadcast
to ``x``'s shape as stride-0 views (no copy either). The row index is split into ``(i0, i1, i2)``
once per row, as a vector, in int32; offsets are int64. The output is contiguous. fp32 inside.

Why tiles: one program per row gives Llama-3-8B's q ``[2, 32, 4096, 128]`` 262,144
programs of 64 half-pairs at one warp each, each paying three int64 divisions and six dependent
128-byte loads before it stores: latency-bound, ~1.1 ms for the backward of q and k on an H100
where the bytes need a tenth of that. Here: 32 rows x 64 half-columns, 4 warps, 8,192 programs for
q and 2,048 for k (``[2, 8, 4096, 128]``), 128-bit loads and stores where the last dim is unit
stride (checked in the PTX for sm_90). Bytes per call, q and k together in bf16, forward or
backward: read x (or grad) 84 MB, write 84 MB, cos/sin ``[2, 1, 4096, 128]`` 2 MB each from HBM
(each row reused by every head, from L2): ~172 MB, ~0.06 ms at ~3 TB/s, the floor to aim at
(one program per row measured 0.26 ms forward, ~1.1 ms backward).

Forward, halves ``1`` and ``2``: ``o1 = x1 c1 - x2 s1``, ``o2 = x2 c2 + x1 s2``.
Backward (``BACKWARD``, the transpose): ``d1 = g1 c1 + g2 s2``, ``d2 = g2 c2 - g1 s1``.

Imported only when a Triton path runs (``kernels/dispatch.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # elements of x a program handles (both halves): 32 rows at D = 128


@triton.jit
def _rope(X, C, S, OUT, NROWS, L1, L2, HALF,
          sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3,
          BACKWARD: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # rows of this tile, split into (i0, i1, i2) once per row (int32: NROWS < 2**31), then int64
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = r < NROWS
    i2 = r % L2
    i01 = r // L2
    i1 = (i01 % L1).to(tl.int64)
    i0 = (i01 // L1).to(tl.int64)
    i2 = i2.to(tl.int64)
    xr = (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None]
    cr = (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None]
    sr = (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None]
    cols = tl.arange(0, BLOCK)
    mask = rmask[:, None] & (cols < HALF)[None, :]
    lo = cols.to(tl.int64)[None, :]
    hi = lo + HALF
    x1 = tl.load(X + xr + lo * sx3, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + xr + hi * sx3, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(C + cr + lo * sc3, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(C + cr + hi * sc3, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(S + sr + lo * ss3, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(S + sr + hi * ss3, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    o = OUT + (r.to(tl.int64) * (2 * HALF))[:, None]
    tl.store(o + lo, o1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(o + hi, o2.to(OUT.dtype.element_ty), mask=mask)


def _as4d(t: torch.Tensor) -> torch.Tensor:
    """``t`` with exactly three leading dims: size-1 dims in front (a view), or the extra leading
    dims merged (a view where the strides allow, else a copy)."""
    if t.dim() <= 4:
        return t[(None,) * (4 - t.dim())]
    return t.reshape(-1, *t.shape[-3:])


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype, backward: bool):
    """``x * cos + rotate_half(x) * sin`` (or its transpose when ``backward``), contiguous."""
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if x.numel() == 0:
        return out
    x4 = _as4d(x)
    c4, s4 = _as4d(cos.expand(x.shape)), _as4d(sin.expand(x.shape))
    half = x.shape[-1] // 2
    l0, l1, l2, _ = x4.shape
    nrows = l0 * l1 * l2
    block = triton.next_power_of_2(half)
    # ~4096 elements a tile (two halves of ROWS x BLOCK), no more rows than there are
    rows = min(max(1, TILE // (2 * block)), triton.next_power_of_2(nrows))
    warps = max(1, min(8, rows * block // 512))
    _rope[(triton.cdiv(nrows, rows),)](
        x4, c4, s4, out, nrows, l1, l2, half, *x4.stride(), *c4.stride(), *s4.stride(),
        BACKWARD=backward, ROWS=rows, BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return out
