"""Triton kernel of ``kernels/rope.py``: rotary position embedding, forward and backward.

One program per row of ``x``'s leading dims (viewed as three: ``[L0, L1, L2, D]``), the two halves
of the last dim as blocks of ``next_power_of_2(D / 2)``. ``x`` (or the incoming gradient) is read
through its strides, so a transposed ``[B, S, H, D] -> [B, H, S, D]`` input needs no copy; ``cos``
and ``sin`` are broadcast to ``x``'s shape as stride-0 views. The output is contiguous. fp32 inside.

Forward, halves ``1`` and ``2``: ``o1 = x1 c1 - x2 s1``, ``o2 = x2 c2 + x1 s2``.
Backward (``BACKWARD``, the transpose): ``d1 = g1 c1 + g2 s2``, ``d2 = g2 c2 - g1 s1``.

Imported only when a Triton path runs (``kernels/dispatch.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope(X, C, S, OUT, L1, L2, HALF,
          sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3,
          BACKWARD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    i2 = (pid % L2).to(tl.int64)
    i1 = ((pid // L2) % L1).to(tl.int64)
    i0 = (pid // (L2 * L1)).to(tl.int64)
    x = X + i0 * sx0 + i1 * sx1 + i2 * sx2
    c = C + i0 * sc0 + i1 * sc1 + i2 * sc2
    s = S + i0 * ss0 + i1 * ss1 + i2 * ss2
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    lo, hi = cols.to(tl.int64), (cols + HALF).to(tl.int64)
    x1 = tl.load(x + lo * sx3, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + hi * sx3, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(c + lo * sc3, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c + hi * sc3, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s + lo * ss3, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s + hi * ss3, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    o = OUT + pid.to(tl.int64) * (2 * HALF)
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
    block = triton.next_power_of_2(half)
    _rope[(l0 * l1 * l2,)](
        x4, c4, s4, out, l1, l2, half, *x4.stride(), *c4.stride(), *s4.stride(),
        BACKWARD=backward, BLOCK=block, num_warps=min(max(block // 128, 1), 8),
    )  # fmt: skip
    return out
