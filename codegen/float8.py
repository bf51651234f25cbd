"""A linear run FP8 on rank-local pieces: torchao's float8 training matmul, amax reduced over the mesh.

``float8_linear(x, w, bias, recipe, axes)`` computes ``x @ w.T + bias`` as torchao's
``Float8Linear`` does with the recipe's ``Float8LinearConfig`` (``"tensorwise"`` or ``"rowwise"``):
each of the six casts (``autopar/lowerings/float8.py``: ``X`` and ``W`` in forward; ``dY`` twice,
``W`` and ``X`` again in backward) takes the operand's amax, turns it into a scale and casts to
``float8_e4m3fn``; the three GEMMs run on torchao's ``Float8TrainingTensor`` (``torch._scaled_mm``
underneath, on CUDA and on CPU), the bias is added after in the high type.

Why not ``Float8Linear`` itself: it computes each amax on the tensor it is given, and reduces it
across ranks only for ``DTensor`` operands (its float8 tensor-parallel styles, FSDP2's float8
all-gather), on one mesh. The generated graph computes on plain local pieces with the plan's own
collectives, so a local amax would scale a shard by its own maximum, not the whole tensor's: not
what the single device computes. So this module runs torchao's own pieces (``tensor_to_amax``,
``amax_to_scale``, ``hp_tensor_and_scale_to_float8``, the ``Float8TrainingTensor`` matmuls, in
torchao's order) and adds the one thing torchao has no local-tensor form of: the ``MAX``
all-reduce of each cast's amax over the mesh axes ``axes[c]`` that shard what the scale reduces
over, written here by hand (``dist.all_reduce`` on the axis's group). The all-reduces are the
calls the description lists, in its order; the cost tables price exactly those.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torchao.float8.config import Float8LinearConfig, ScalingType
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
from torchao.float8.float8_training_tensor import (
    GemmInputRole,
    LinearMMConfig,
    ScaledMMConfig,
    hp_tensor_and_scale_to_float8,
)
from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

from autopar.codegen.collectives import axis_group, current_mesh

__all__ = ["float8_config", "float8_linear"]


@functools.cache
def float8_config(recipe: str) -> tuple[Float8LinearConfig, LinearMMConfig]:
    """torchao's config of ``recipe`` and the GEMM configs its ``Float8Linear`` builds from it."""
    c = Float8LinearConfig.from_recipe_name(recipe)
    mm = LinearMMConfig(
        *(
            ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim)
            for g in (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)
        )
    )
    return c, mm


def amax_all_reduce(amax: torch.Tensor, group: dist.ProcessGroup) -> None:
    """The max of ``amax`` over ``group``, in place: the one collective of an FP8 linear."""
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)


def _cast(x, cast, role, dim, c, mm, mesh, axes: Sequence[int]):
    """``x`` cast to float8 as torchao's ``hp_tensor_to_float8_dynamic`` casts it, its amax first
    all-reduced (max) over ``axes`` of ``mesh``; ``x`` itself where the cast is disabled."""
    if cast.scaling_type is ScalingType.DISABLED:
        return x
    axiswise = get_maybe_axiswise_dim(dim, cast.scaling_granularity)
    amax = tensor_to_amax(x, False, None, cast.scaling_granularity, axiswise)
    if axes:
        # exact in fp32: a max of values of x's dtype (gloo has no bf16 max)
        amax = amax.float()
        for a in axes:
            amax_all_reduce(amax, axis_group(mesh, a))
    scale = amax_to_scale(amax, cast.target_dtype, c.round_scales_to_power_of_2)
    return hp_tensor_and_scale_to_float8(x, scale, cast.target_dtype, mm, role, axiswise)


class _Float8Matmul(torch.autograd.Function):
    """``x @ w_t`` with the casts of torchao's ``matmul_with_hp_or_float8_args``, each reduced over
    its axes (module docstring); ``axes``: six tuples, in ``lowerings/float8.py``'s cast order."""

    @staticmethod
    def forward(ctx, x, w_t, recipe: str, axes, mesh):
        ctx.save_for_backward(x, w_t)
        ctx.recipe, ctx.axes, ctx.mesh = recipe, axes, mesh
        c, mm = float8_config(recipe)
        xf = _cast(x, c.cast_config_input, GemmInputRole.INPUT, -1, c, mm, mesh, axes[0])
        wf = _cast(w_t, c.cast_config_weight, GemmInputRole.WEIGHT, 0, c, mm, mesh, axes[1])
        shape = xf.shape
        y = torch.mm(xf.reshape(-1, shape[-1]), wf)
        return y.reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x, w_t = ctx.saved_tensors
        c, mm = float8_config(ctx.recipe)
        axes, mesh = ctx.axes, ctx.mesh
        shape = dy.shape
        dy2 = dy.reshape(-1, shape[-1])
        g0 = _cast(dy2, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1, c, mm, mesh, axes[2])
        w0 = _cast(w_t, c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1, c, mm, mesh, axes[3])
        dx = torch.mm(g0, w0.t()).reshape(*shape[:-1], w_t.shape[0])
        g1 = _cast(
            dy2, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, 0, c, mm, mesh, axes[4]
        )
        x1 = _cast(
            x.reshape(-1, x.shape[-1]), c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0, c, mm,
            mesh, axes[5],
        )  # fmt: skip
        dw = torch.mm(g1.t(), x1)
        return dx, dw.t(), None, None, None


def float8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: str,
    axes: tuple[tuple[int, ...], ...],
) -> torch.Tensor:
    """``linear(x, w, bias)`` run FP8 with torchao's ``recipe``, each cast's amax all-reduced over its
    ``axes`` of the bound mesh (module docstring). Under autocast the input is cast to the autocast
    type first, as ``Float8Linear.forward`` does."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        x = x.to(torch.get_autocast_dtype(kind))
    mesh = current_mesh() if any(axes) else None
    y = _Float8Matmul.apply(x, w.t(), recipe, axes, mesh)
    return y if bias is None else y + bias.to(y.dtype)
