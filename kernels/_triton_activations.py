"""Triton kernels of ``kernels/activations.py``: SwiGLU and GeGLU, forward and backward.

Elementwise over the flattened (contiguous) tensors, ``BLOCK`` elements per program, fp32 inside:
loads through ``.to(tl.float32)``, stores through ``.to(PTR.dtype.element_ty)``. ``ACT`` picks the
activation: 0 SiLU, 1 GELU (erf), 2 GELU (tanh approximation). The backward recomputes the
activation from ``gate``.

Imported only when a Triton path runs (``kernels/dispatch.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU, GELU, GELU_TANH = 0, 1, 2
BLOCK = 1024
# globals a jitted function reads must be constexpr
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_INV_SQRT_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _act(g, ACT: tl.constexpr):
    """``(act(g), act'(g))`` in fp32."""
    if ACT == 0:
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(g * _INV_SQRT_2))
        a = g * cdf
        da = cdf + g * tl.exp(-0.5 * g * g) * _INV_SQRT_2PI
    else:
        inner = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        e = tl.exp(-2.0 * tl.abs(inner))  # tanh(inner), without overflow for large |inner|
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(inner < 0, -t, t)
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * g * g)
    return a, da


@triton.jit
def _glu_fwd(G, U, OUT, numel, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act(g, ACT)
    tl.store(OUT + offs, (a * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd(DO, G, U, DG, DU, numel, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    a, da = _act(g, ACT)
    tl.store(DG + offs, (do * u * da).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (do * a).to(DU.dtype.element_ty), mask=mask)


def glu_forward(gate, up, act, out_dtype):
    """``act(gate) * up`` for contiguous ``gate`` and ``up`` of one shape."""
    out = torch.empty(gate.shape, dtype=out_dtype, device=gate.device)
    n = gate.numel()
    if n:
        _glu_fwd[(triton.cdiv(n, BLOCK),)](gate, up, out, n, ACT=act, BLOCK=BLOCK, num_warps=4)
    return out


def glu_backward(grad, gate, up, act):
    """``(dgate, dup)`` in ``gate``'s and ``up``'s dtypes, all inputs contiguous."""
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    n = gate.numel()
    if n:
        _glu_bwd[(triton.cdiv(n, BLOCK),)](grad, gate, up, dgate, dup, n, ACT=act, BLOCK=BLOCK, num_warps=4)
    return dgate, dup
