"""Fused gated activations of transformer MLPs: ``torch.ops.autopar.swiglu`` and
``torch.ops.autopar.geglu``.

* ``swiglu(gate, up) = silu(gate) * up`` (Llama, Mistral, Qwen: ``act_fn(gate_proj(x)) * up_proj(x)``);
* ``geglu(gate, up, approximate) = gelu(gate, approximate) * up`` (``approximate`` "none": erf,
  "tanh": the tanh approximation; Gemma's ``gelu_pytorch_tanh``).

``gate`` and ``up`` have one shape; the output has it too, dtype ``promote_types(gate, up)``,
computed in fp32 and rounded once (eager bf16 rounds ``act(gate)`` first: equal within bf16
tolerance). Saved for backward: ``gate`` and ``up`` only (the activation and its derivative are
recomputed from ``gate``), none of the ``act(gate)`` intermediate eager autograd keeps.

The backward is its own custom op (``autopar::swiglu_backward``, ``autopar::geglu_backward``) with a
fake implementation, so both trace and run on the meta device. Importing this module registers them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from autopar.kernels.dispatch import use_triton

_APPROXIMATE = ("none", "tanh")


def _check(gate: Tensor, up: Tensor, approximate: str = "none") -> torch.dtype:
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    if approximate not in _APPROXIMATE:
        raise ValueError(f"approximate={approximate!r} is not one of {_APPROXIMATE}")
    return torch.promote_types(gate.dtype, up.dtype)


def _act_id(approximate: str | None) -> int:
    return 0 if approximate is None else 1 + _APPROXIMATE.index(approximate)


def _forward(gate: Tensor, up: Tensor, approximate: str | None) -> Tensor:
    out_dtype = _check(gate, up, approximate or "none")
    if use_triton(gate, up):
        from autopar.kernels._triton_activations import glu_forward

        return glu_forward(gate.contiguous(), up.contiguous(), _act_id(approximate), out_dtype)
    g = gate.float()
    a = F.silu(g) if approximate is None else F.gelu(g, approximate=approximate)
    return (a * up.float()).to(out_dtype).contiguous()


def _act_and_grad(g: Tensor, approximate: str | None) -> tuple[Tensor, Tensor]:
    """``(act(g), act'(g))`` in fp32, written out as the Triton kernel computes them."""
    if approximate is None:
        s = torch.sigmoid(g)
        return g * s, s * (1 + g * (1 - s))
    if approximate == "none":
        cdf = 0.5 * (1 + torch.erf(g * (1 / math.sqrt(2))))
        return g * cdf, cdf + g * torch.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)
    k = math.sqrt(2 / math.pi)
    t = torch.tanh(k * (g + 0.044715 * g**3))
    return 0.5 * g * (1 + t), 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * 0.044715 * g * g)


def _backward(grad: Tensor, gate: Tensor, up: Tensor, approximate: str | None) -> tuple[Tensor, Tensor]:
    if use_triton(grad, gate, up):
        from autopar.kernels._triton_activations import glu_backward

        return glu_backward(grad.contiguous(), gate.contiguous(), up.contiguous(), _act_id(approximate))
    a, da = _act_and_grad(gate.float(), approximate)
    do = grad.float()
    dgate = (do * up.float() * da).to(gate.dtype).contiguous()
    return dgate, (do * a).to(up.dtype).contiguous()


def _fake_backward(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return (
        torch.empty_like(gate, memory_format=torch.contiguous_format),
        torch.empty_like(up, memory_format=torch.contiguous_format),
    )


# ---------------------------------------------------------------------------------------- SwiGLU


@torch.library.custom_op("autopar::swiglu", mutates_args=())
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up = gate * sigmoid(gate) * up``."""
    return _forward(gate, up, None)


@swiglu.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape, dtype=_check(gate, up))


@torch.library.custom_op("autopar::swiglu_backward", mutates_args=())
def swiglu_backward(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """With ``s = sigmoid(gate)``: ``dgate = grad * up * s * (1 + gate * (1 - s))``,
    ``dup = grad * gate * s``."""
    return _backward(grad, gate, up, None)


swiglu_backward.register_fake(_fake_backward)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, grad):
    return torch.ops.autopar.swiglu_backward(grad, *ctx.saved_tensors)


swiglu.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


# ----------------------------------------------------------------------------------------- GeGLU


@torch.library.custom_op("autopar::geglu", mutates_args=())
def geglu(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    """``gelu(gate, approximate) * up``: ``gelu(g) = g * Phi(g)`` ("none", erf) or
    ``0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3)))`` ("tanh")."""
    return _forward(gate, up, approximate)


@geglu.register_fake
def _(gate, up, approximate):
    return gate.new_empty(gate.shape, dtype=_check(gate, up, approximate))


@torch.library.custom_op("autopar::geglu_backward", mutates_args=())
def geglu_backward(grad: Tensor, gate: Tensor, up: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    """``dgate = grad * up * gelu'(gate)``, ``dup = grad * gelu(gate)``."""
    return _backward(grad, gate, up, approximate)


@geglu_backward.register_fake
def _(grad, gate, up, approximate):
    return _fake_backward(grad, gate, up)


def _geglu_setup(ctx, inputs, output):
    gate, up, approximate = inputs
    ctx.save_for_backward(gate, up)
    ctx.approximate = approximate


def _geglu_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    dgate, dup = torch.ops.autopar.geglu_backward(grad, gate, up, ctx.approximate)
    return dgate, dup, None


geglu.register_autograd(_geglu_backward, setup_context=_geglu_setup)
