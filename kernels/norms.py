"""Fused RMSNorm and LayerNorm over the last dim, with the residual add in front:
``torch.ops.autopar.rms_norm`` and ``torch.ops.autopar.layer_norm``.

Both take ``(x, residual, ...)`` and return ``(y, h)``: ``h = x + residual`` (in ``x``'s dtype
promoted with ``residual``'s, rounded as eager ``x + residual``; a fresh copy of ``x`` when
``residual`` is None, since a custom op may not return an alias of an input) and ``y`` the norm of
``h``. Returning ``h`` lets one op replace the "add to the residual stream, then norm it" pair of a
transformer block; the gradient reaching ``h`` from its later uses is added to the one through
``y``, and the sum is the gradient of both ``x`` and ``residual``.

Saved for backward: ``h`` (an output, alive anyway as the residual stream) and ``weight``; the
per-row statistics (mean, rstd) are recomputed from ``h`` in the backward kernel, which loads the
row anyway, so no fp32 copy of anything is kept (a Triton or fallback backward costs one extra
reduction per row instead of ``4 * rows`` bytes per statistic).

The backward is its own custom op (``autopar::rms_norm_backward``, ``autopar::layer_norm_backward``)
with a fake implementation, so forward and backward both trace and run on the meta device. Its
weight/bias gradients are empty ``(0,)`` tensors where the op has no weight/bias (a custom op cannot
return None). Importing this module registers the ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from autopar.kernels.dispatch import use_triton


def _h_dtype(x: Tensor, residual: Tensor | None) -> torch.dtype:
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


def _y_dtype(h_dtype: torch.dtype, *params: Tensor | None) -> torch.dtype:
    for p in params:
        if p is not None:
            h_dtype = torch.promote_types(h_dtype, p.dtype)
    return h_dtype


def _check(x: Tensor, residual: Tensor | None, *params: Tensor | None) -> None:
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
    for p in params:
        if p is not None and tuple(p.shape) != (x.shape[-1],):
            raise ValueError(f"weight/bias {tuple(p.shape)} must be ({x.shape[-1]},): x's last dim")


def _residual_add(x: Tensor, residual: Tensor | None) -> Tensor:
    h = x + residual if residual is not None else x.clone()
    return h.contiguous()


def _empty(like: Tensor) -> Tensor:
    return like.new_empty((0,), dtype=torch.float32)


# --------------------------------------------------------------------------------------- RMSNorm


@torch.library.custom_op("autopar::rms_norm", mutates_args=())
def rms_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, eps: float, weight_offset: float
) -> tuple[Tensor, Tensor]:
    """``h = x + residual`` (or ``x``); ``y = h * rsqrt(mean(h**2, -1) + eps) * (weight + weight_offset)``.

    Statistics in fp32, ``y`` rounded once to ``promote_types(h.dtype, weight.dtype)`` (``h.dtype``
    without weight). ``weight_offset`` is 0 for Llama/Mistral/Qwen and 1 for Gemma's ``1 + weight``.
    """
    _check(x, residual, weight)
    y_dtype = _y_dtype(_h_dtype(x, residual), weight)
    if use_triton(x, residual, weight):
        from autopar.kernels._triton_norms import norm_forward

        r = residual.contiguous() if residual is not None else None
        w = weight.contiguous() if weight is not None else None
        return norm_forward(x.contiguous(), r, w, None, eps, weight_offset, True, y_dtype)
    h = _residual_add(x, residual)
    hf = h.float()
    n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        n = n * (weight.float() + weight_offset)
    return n.to(y_dtype), h


@rms_norm.register_fake
def _(x, residual, weight, eps, weight_offset):
    _check(x, residual, weight)
    h_dtype = _h_dtype(x, residual)
    return x.new_empty(x.shape, dtype=_y_dtype(h_dtype, weight)), x.new_empty(x.shape, dtype=h_dtype)


@torch.library.custom_op("autopar::rms_norm_backward", mutates_args=())
def rms_norm_backward(
    grad_y: Tensor | None,
    grad_h: Tensor | None,
    h: Tensor,
    weight: Tensor | None,
    eps: float,
    weight_offset: float,
) -> tuple[Tensor, Tensor]:
    """``(dh, dweight)``. With ``n = h * rstd``, ``g = grad_y * (weight + weight_offset)``:
    ``dh = rstd * (g - n * mean(g * n, -1)) + grad_h`` (in ``h``'s dtype), ``dweight = sum over rows
    of grad_y * n`` (fp32 accumulation, weight's dtype; empty when there is no weight)."""
    if use_triton(h, grad_y, grad_h, weight):
        from autopar.kernels._triton_norms import norm_backward

        dy = grad_y.contiguous() if grad_y is not None else None
        dhin = grad_h.contiguous() if grad_h is not None else None
        w = weight.contiguous() if weight is not None else None
        dh, dw, _ = norm_backward(dy, dhin, h.contiguous(), w, False, eps, weight_offset, True)
        return dh, dw.to(weight.dtype) if weight is not None else _empty(h)
    hf = h.float()
    dh = torch.zeros_like(hf)
    dw = _empty(h)
    if grad_y is not None:
        rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        n = hf * rstd
        dy = grad_y.float()
        g = dy * (weight.float() + weight_offset) if weight is not None else dy
        dh = rstd * (g - n * (g * n).mean(-1, keepdim=True))
        if weight is not None:
            dw = (dy * n).reshape(-1, h.shape[-1]).sum(0).to(weight.dtype)
    if grad_h is not None:
        dh = dh + grad_h.float()
    return dh.to(h.dtype).contiguous(), dw


@rms_norm_backward.register_fake
def _(grad_y, grad_h, h, weight, eps, weight_offset):
    return torch.empty_like(h, memory_format=torch.contiguous_format), (
        torch.empty_like(weight) if weight is not None else _empty(h)
    )


def _rms_setup(ctx, inputs, output):
    x, residual, weight, eps, weight_offset = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.eps, ctx.offset = eps, weight_offset
    ctx.dtypes = x.dtype, residual.dtype if residual is not None else None


def _rms_backward(ctx, grad_y, grad_h):
    h, weight = ctx.saved_tensors
    dh, dw = torch.ops.autopar.rms_norm_backward(grad_y, grad_h, h, weight, ctx.eps, ctx.offset)
    dx, dres = _split(dh, ctx.dtypes)
    return dx, dres, dw if weight is not None else None, None, None


def _split(dh: Tensor, dtypes) -> tuple[Tensor, Tensor | None]:
    """``h = x + residual``: both get ``dh`` (the same tensor where the dtypes agree)."""
    x_dtype, res_dtype = dtypes
    return dh.to(x_dtype), dh.to(res_dtype) if res_dtype is not None else None


rms_norm.register_autograd(_rms_backward, setup_context=_rms_setup)


# ------------------------------------------------------------------------------------- LayerNorm


@torch.library.custom_op("autopar::layer_norm", mutates_args=())
def layer_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """``h = x + residual`` (or ``x``); ``y = (h - mean) * rsqrt(var + eps) * weight + bias`` over the
    last dim (biased variance, as torch), statistics in fp32, ``y`` rounded once to the promoted
    dtype of ``h``, ``weight`` and ``bias``."""
    _check(x, residual, weight, bias)
    y_dtype = _y_dtype(_h_dtype(x, residual), weight, bias)
    if use_triton(x, residual, weight, bias):
        from autopar.kernels._triton_norms import norm_forward

        r = residual.contiguous() if residual is not None else None
        w = weight.contiguous() if weight is not None else None
        b = bias.contiguous() if bias is not None else None
        return norm_forward(x.contiguous(), r, w, b, eps, 0.0, False, y_dtype)
    h = _residual_add(x, residual)
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    return F.layer_norm(h.float(), (h.shape[-1],), w, b, eps).to(y_dtype), h


@layer_norm.register_fake
def _(x, residual, weight, bias, eps):
    _check(x, residual, weight, bias)
    h_dtype = _h_dtype(x, residual)
    y_dtype = _y_dtype(h_dtype, weight, bias)
    return x.new_empty(x.shape, dtype=y_dtype), x.new_empty(x.shape, dtype=h_dtype)


@torch.library.custom_op("autopar::layer_norm_backward", mutates_args=())
def layer_norm_backward(
    grad_y: Tensor | None,
    grad_h: Tensor | None,
    h: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dh, dweight, dbias)``. With ``n = (h - mean) * rstd``, ``g = grad_y * weight``:
    ``dh = rstd * (g - mean(g) - n * mean(g * n)) + grad_h``; ``dweight = sum_rows(grad_y * n)``,
    ``dbias = sum_rows(grad_y)`` (fp32 accumulation, cast to their dtypes; empty where absent)."""
    if use_triton(h, grad_y, grad_h, weight, bias):
        from autopar.kernels._triton_norms import norm_backward

        dy = grad_y.contiguous() if grad_y is not None else None
        dhin = grad_h.contiguous() if grad_h is not None else None
        w = weight.contiguous() if weight is not None else None
        dh, dw, db = norm_backward(dy, dhin, h.contiguous(), w, bias is not None, eps, 0.0, False)
        dw = dw.to(weight.dtype) if weight is not None else _empty(h)
        return dh, dw, db.to(bias.dtype) if bias is not None else _empty(h)
    hf = h.float()
    dh = torch.zeros_like(hf)
    dw, db = _empty(h), _empty(h)
    if grad_y is not None:
        mean = hf.mean(-1, keepdim=True)
        rstd = torch.rsqrt(hf.var(-1, unbiased=False, keepdim=True) + eps)
        n = (hf - mean) * rstd
        dy = grad_y.float()
        g = dy * weight.float() if weight is not None else dy
        dh = rstd * (g - g.mean(-1, keepdim=True) - n * (g * n).mean(-1, keepdim=True))
        if weight is not None:
            dw = (dy * n).reshape(-1, h.shape[-1]).sum(0).to(weight.dtype)
        if bias is not None:
            db = dy.reshape(-1, h.shape[-1]).sum(0).to(bias.dtype)
    if grad_h is not None:
        dh = dh + grad_h.float()
    return dh.to(h.dtype).contiguous(), dw, db


@layer_norm_backward.register_fake
def _(grad_y, grad_h, h, weight, bias, eps):
    dw = torch.empty_like(weight) if weight is not None else _empty(h)
    db = torch.empty_like(bias) if bias is not None else _empty(h)
    return torch.empty_like(h, memory_format=torch.contiguous_format), dw, db


def _ln_setup(ctx, inputs, output):
    x, residual, weight, bias, eps = inputs
    ctx.save_for_backward(output[1], weight, bias)
    ctx.eps = eps
    ctx.dtypes = x.dtype, residual.dtype if residual is not None else None


def _ln_backward(ctx, grad_y, grad_h):
    h, weight, bias = ctx.saved_tensors
    dh, dw, db = torch.ops.autopar.layer_norm_backward(grad_y, grad_h, h, weight, bias, ctx.eps)
    dx, dres = _split(dh, ctx.dtypes)
    return dx, dres, dw if weight is not None else None, db if bias is not None else None, None


layer_norm.register_autograd(_ln_backward, setup_context=_ln_setup)
