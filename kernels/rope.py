"""Rotary position embedding: ``torch.ops.autopar.rope``.

``rope(x, cos, sin) = x * cos + rotate_half(x) * sin`` over the last dim ``D`` (even), with Hugging
Face's ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``. ``cos`` and ``sin`` broadcast to ``x``
(typically ``x`` is ``[B, H, S, D]``, often a transpose of ``[B, S, H, D]``, and ``cos``/``sin`` are
``[B, 1, S, D]`` or ``[1, 1, S, D]``). The output has ``x``'s shape, is contiguous, and has dtype
``promote_types(x, cos, sin)``.

Backward: ``grad_x = g * cos + rotate_half^T(g * sin)`` with ``rotate_half^T(u) = cat(u[..., D/2:],
-u[..., :D/2])``. ``cos`` and ``sin`` get no gradient (None): they are buffers computed from the
positions, never trained; a ``cos``/``sin`` that requires grad is treated as a constant. Saved for
backward: ``cos`` and ``sin`` only (shared by every layer, so usually alive anyway), nothing of ``x``.

The backward is its own custom op (``autopar::rope_backward``) with a fake implementation, so both
trace and run on the meta device. Importing this module registers them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from autopar.kernels.dispatch import use_triton


def _check(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"rope needs an even last dim, got x of shape {tuple(x.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not _broadcasts_to(t.shape, x.shape):
            raise ValueError(f"{name} {tuple(t.shape)} does not broadcast to x {tuple(x.shape)}")


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    """Whether ``shape`` broadcasts to ``target``. Plain ints (every eager call, forward and
    backward) are compared directly: ``torch.broadcast_shapes`` goes through ``torch._refs`` and its
    symbolic-shape guards, ~30 us of host time a call, twice a call here, more than the kernel of a
    small tensor. Symbolic shapes (tracing) still go through it."""
    if all(type(n) is int for n in (*shape, *target)):
        return len(shape) <= len(target) and all(
            a == 1 or a == b for a, b in zip(reversed(shape), reversed(target))
        )
    return torch.broadcast_shapes(shape, target) == target


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_half_t(u: Tensor) -> Tensor:
    u1, u2 = u.chunk(2, dim=-1)
    return torch.cat((u2, -u1), dim=-1)


@torch.library.custom_op("autopar::rope", mutates_args=())
def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x * cos + rotate_half(x) * sin``, contiguous, dtype ``promote_types(x, cos, sin)``.

    The fallback is the eager expression itself (Hugging Face's ``apply_rotary_pos_emb``); the
    Triton kernel computes it in fp32 and rounds once.
    """
    _check(x, cos, sin)
    out_dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    if use_triton(x, cos, sin):
        from autopar.kernels._triton_rope import rope as rope_triton

        return rope_triton(x, cos, sin, out_dtype, backward=False)
    return (x * cos + _rotate_half(x) * sin).contiguous()


@rope.register_fake
def _(x, cos, sin):
    _check(x, cos, sin)
    out_dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("autopar::rope_backward", mutates_args=())
def rope_backward(grad: Tensor, cos: Tensor, sin: Tensor, dtype: torch.dtype) -> Tensor:
    """``grad * cos + rotate_half^T(grad * sin)`` in ``dtype`` (``x``'s), contiguous."""
    _check(grad, cos, sin)
    if use_triton(grad, cos, sin):
        from autopar.kernels._triton_rope import rope as rope_triton

        return rope_triton(grad, cos, sin, dtype, backward=True)
    g = grad.float()
    return (g * cos.float() + _rotate_half_t(g * sin.float())).to(dtype).contiguous()


@rope_backward.register_fake
def _(grad, cos, sin, dtype):
    _check(grad, cos, sin)
    return grad.new_empty(grad.shape, dtype=dtype)


def _setup(ctx, inputs, output):
    x, cos, sin = inputs
    ctx.save_for_backward(cos, sin)
    ctx.dtype = x.dtype


def _backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    return torch.ops.autopar.rope_backward(grad, cos, sin, ctx.dtype), None, None


rope.register_autograd(_backward, setup_context=_setup)
