r"""Grouped matrix multiply: one matmul per group of consecutive rows, as mixture-of-experts layers run.

``torch.ops.autopar.grouped_mm(x, w, offs) -> out``: ``x`` ``[N, K]`` holds rows grouped by expert,
group ``g`` the rows ``offs[g-1] : offs[g]`` (``offs`` int32, the cumulative ends, length ``G``,
``offs[-1] <= N``, ``offs[-1]`` of group ``-1`` read as 0); ``w`` ``[G, K, M]``, any strides (a
transposed view of ``[G, M, K]`` storage is the usual case). Then

.. math::

    \mathrm{out}[r] = x[r]\, w[g]\ \ \text{for } \mathrm{offs}[g-1] \le r < \mathrm{offs}[g],
    \qquad \mathrm{out}[r] = 0\ \ \text{for } r \ge \mathrm{offs}[G-1]

    \nabla x = \mathrm{grouped\_mm}(\nabla \mathrm{out},\ w^\top,\ \mathrm{offs}),\qquad
    \nabla w[g] = x_g^\top\, \nabla \mathrm{out}_g \quad (\text{zeros for an empty group})

The weight gradient is its own op, ``torch.ops.autopar.grouped_mm_weight_grad(x, dy, offs, G) ->
[G, K, M]``. Both ops have fake implementations (shapes need no data: the output has ``N`` rows
whatever the offsets say), so they run on meta and fake tensors, and FLOP formulas for
``FlopCounterMode`` (how ``passes/analyze.py`` prices a node): ``2 N K M`` each, the rows past
``offs[-1]`` counted too (an upper bound: the offsets are data).

Implementation (``choose_path``, a pure function of the backend, the device kind, the dtype and
what runs, so it is tested without a GPU):

* ``torch._grouped_mm`` where this build has it and it runs on the tensors' (device, dtype) (one
  real try on first use per pair, cached: CUDA bf16 on sm90+, CPU float32 and bf16 in torch
  2.13), its operands' strides are multiples of 16 bytes (the kernel's requirement) and
  ``AUTOPAR_KERNELS`` is ``auto``; its rows past ``offs[-1]`` are left unwritten, so they are
  zeroed after.
* the Triton kernels (``kernels/_triton_grouped_mm.py``, one launch over all groups) on CUDA where
  the first does not run (sm80, fp16 / fp32, unaligned shapes) and Triton imports, for fp16, bf16
  and fp32; always under ``AUTOPAR_KERNELS=triton`` (on CPU tensors through Triton's interpreter,
  how the tests run it).
* elsewhere (CPU without the first, float64, ``AUTOPAR_KERNELS=torch``) a loop of ``torch.mm``
  over the groups, one host read of ``offs``.
"""

from __future__ import annotations

import enum
import functools

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from autopar.kernels.dispatch import Backend, backend, triton_available, use_triton

ALIGN_BYTES = 16  # torch._grouped_mm's stride requirement


def _check(x: Tensor, w: Tensor, offs: Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or offs.dim() != 1:
        raise ValueError(
            f"grouped_mm takes x [N, K], w [G, K, M], offs [G]: got x {tuple(x.shape)}, w {tuple(w.shape)}, "
            f"offs {tuple(offs.shape)}"
        )
    if x.shape[1] != w.shape[1] or offs.shape[0] != w.shape[0]:
        raise ValueError(
            f"grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)} and offs {tuple(offs.shape)} disagree "
            "(x [N, K], w [G, K, M], offs [G])"
        )
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_mm: x is {x.dtype}, w {w.dtype}: cast x to the weights' dtype")
    if offs.dtype.is_floating_point or offs.dtype == torch.bool:
        raise ValueError(f"grouped_mm: offs are cumulative row counts (int32), not {offs.dtype}")


def strides_aligned(*tensors: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands' layouts: 16-byte aligned data, and of the
    last two dims one of stride 1 with the other's stride a multiple of 16 bytes and at least the
    first's size (a row- or column-major matrix), the batch stride of a 3-D operand aligned too.
    Which dim is the unit-stride one is decided as PyTorch's check decides it (row-major first
    where both could be): ``x [N, 1]`` has strides ``(1, 1)`` and is read row-major, its row stride
    4 bytes, so it is refused although no dim of size > 1 has a stride but 1."""
    for t in tensors:
        align = ALIGN_BYTES // t.element_size()
        if t.data_ptr() % ALIGN_BYTES or ALIGN_BYTES % t.element_size():
            return False
        rows, cols = t.stride()[-2:]
        n_rows, n_cols = t.shape[-2:]
        if cols == 1 and rows >= max(1, n_cols):
            lead = rows
        elif rows == 1 and cols >= max(1, n_rows):
            lead = cols
        else:
            return False
        if lead % align or (t.dim() == 3 and t.shape[0] > 1 and t.stride(0) % align):
            return False
    return True


@functools.cache
def fast_path_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` exists and runs on ``(device, dtype)``: one real try, cached."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return False
    try:
        x = torch.ones(4, 16, device=device, dtype=dtype)
        w = torch.ones(2, 16, 16, device=device, dtype=dtype)
        offs = torch.tensor([2, 4], device=device, dtype=torch.int32)
        out = fn(x, w, offs=offs)
        return bool((out == 16).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def uses_fast_path(*tensors: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs on these operands (``x``, then ``w``) and ``AUTOPAR_KERNELS``
    lets it (anything but ``torch``; ``choose_path`` prefers Triton to it only under ``triton``)."""
    first = tensors[0]
    return (
        backend() is not Backend.TORCH
        and first.dtype == tensors[1].dtype
        and fast_path_runs(first.device, first.dtype)
        and strides_aligned(*tensors)
    )


class Path(enum.Enum):
    """What runs a grouped matmul."""

    GROUPED_MM = "torch._grouped_mm"
    TRITON = "triton"
    LOOP = "loop"


TRITON_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})


def choose_path(
    kernels: Backend, device_type: str, dtype: torch.dtype, grouped_mm_runs: bool, triton: bool
) -> Path:
    """The implementation for operands of ``dtype`` on a ``device_type`` device, under
    ``AUTOPAR_KERNELS=kernels``, where ``torch._grouped_mm`` runs on them (``grouped_mm_runs``:
    built, working on this (device, dtype), strides aligned) and Triton imports (``triton``)."""
    if kernels is Backend.TORCH:
        return Path.LOOP
    if kernels is Backend.TRITON and dtype in TRITON_DTYPES:
        return Path.TRITON
    if grouped_mm_runs:
        return Path.GROUPED_MM
    if device_type == "cuda" and triton and dtype in TRITON_DTYPES:
        return Path.TRITON
    return Path.LOOP


def path_for(a: Tensor, b: Tensor) -> Path:
    """``choose_path`` for the operands ``a`` and ``b`` of one ``torch._grouped_mm`` call."""
    kernels = backend()
    if kernels is Backend.TRITON and a.dtype in TRITON_DTYPES:
        use_triton(a, b)  # raises, naming the fix, where Triton cannot run these tensors
    device = "cuda" if a.is_cuda and b.is_cuda else a.device.type
    runs = uses_fast_path(a, b)
    triton = device == "cuda" and kernels is Backend.AUTO and triton_available()
    return choose_path(kernels, device, a.dtype, runs, triton)


def _zero_tail(out: Tensor, offs: Tensor) -> Tensor:
    """``out`` with the rows at or past ``offs[-1]`` set to 0 (no host read of ``offs``)."""
    if offs.numel() == 0:
        return out.zero_()
    rows = torch.arange(out.shape[0], device=out.device)
    return out.masked_fill_((rows >= offs[-1]).unsqueeze(-1), 0)


def _ends(offs: Tensor) -> list[int]:
    return [int(e) for e in offs.tolist()]


@torch.library.custom_op("autopar::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """``out[N, M]``: group ``g``'s rows of ``x`` times ``w[g]``; rows past ``offs[-1]`` zero."""
    _check(x, w, offs)
    offs32 = offs.to(torch.int32)
    path = path_for(x, w)
    if path is Path.GROUPED_MM:
        return _zero_tail(torch._grouped_mm(x, w, offs=offs32), offs32)
    if path is Path.TRITON:
        from autopar.kernels import _triton_grouped_mm

        return _triton_grouped_mm.grouped_mm(x, w, offs32)
    out = x.new_zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, end in enumerate(_ends(offs)):
        if end > start:
            torch.mm(x[start:end], w[g], out=out[start:end])
        start = end
    return out


@grouped_mm.register_fake
def _(x, w, offs):
    _check(x, w, offs)
    return x.new_empty((x.shape[0], w.shape[2]))


@torch.library.custom_op("autopar::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(x: Tensor, dy: Tensor, offs: Tensor, groups: int) -> Tensor:
    """``dw[G, K, M]``: ``dw[g] = x_g^T dy_g`` over group ``g``'s rows; zeros for an empty group."""
    offs32 = offs.to(torch.int32)
    xt = x.t()
    path = path_for(xt, dy)
    if path is Path.TRITON:
        from autopar.kernels import _triton_grouped_mm

        return _triton_grouped_mm.grouped_mm_weight_grad(x, dy, offs32, groups)
    if groups == offs.shape[0] and path is Path.GROUPED_MM:
        out = torch._grouped_mm(xt, dy, offs=offs32)
        # an empty group's block may be left unwritten
        empty = torch.diff(offs32, prepend=offs32.new_zeros(1)) == 0
        return out.masked_fill_(empty.view(-1, 1, 1), 0)
    out = x.new_zeros((groups, x.shape[1], dy.shape[1]))
    start = 0
    for g, end in enumerate(_ends(offs)):
        if end > start:
            torch.mm(xt[:, start:end], dy[start:end], out=out[g])
        start = end
    return out


@grouped_mm_weight_grad.register_fake
def _(x, dy, offs, groups):
    return x.new_empty((groups, x.shape[1], dy.shape[1]))


def _setup_context(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, dy):
    x, w, offs = ctx.saved_tensors
    dy = dy.contiguous()
    dx = grouped_mm(dy, w.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    dw = grouped_mm_weight_grad(x, dy, offs, w.shape[0]) if ctx.needs_input_grad[1] else None
    return dx, dw, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.autopar.grouped_mm)
def _forward_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    """``2 N K M``: every row of ``x`` times one ``[K, M]`` matrix."""
    return 2 * x_shape[0] * x_shape[1] * w_shape[2]


@register_flop_formula(torch.ops.autopar.grouped_mm_weight_grad)
def _weight_grad_flops(x_shape, dy_shape, *args, out_shape=None, **kwargs) -> int:
    """``2 N K M``: every row's outer product ``x[r]^T dy[r]`` summed into its group's block."""
    return 2 * x_shape[0] * x_shape[1] * dy_shape[1]
