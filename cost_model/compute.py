"""Compute costs in seconds: a roofline per op, forward and backward.

For one node run on a rank that does ``1/k`` of the work (``k`` = ``Strategy.work_divisor``: the
product of the mesh axes on which an input or the output is Shard; Partial inputs divide nothing):

    t_fwd = max(F / k / (peak(dtype) * eff(F / k)) + o,  M / k / bw,  U / k * p_fwd(op)) + launch  [s]
    t_bwd = max(min(g, 2) * (t_fwd - launch),  U / k * p_bwd(op),  G / k / bw)         + launch  [s]

(``t_bwd`` only when the output needs a gradient; otherwise the node costs ``t_fwd``.)

* ``F``: forward FLOPs of the global op (torch.utils.flop_counter); ``M``: bytes moved (inputs +
  outputs; 0 for a view, which moves nothing); ``E``: elements of the op's largest tensor.
* ``peak(dtype)``: dense peak FLOP/s of the device for the op's dtype (ClusterSpec presets,
  datasheet figures, or ``autopar calibrate``).
* ``bw``: ``DeviceSpec.memory_bandwidth`` [B/s]; calibrated as a step sees it (each op writing a
  fresh tensor, its inputs produced a while before: ``autopar/tools/calibrate_compute.py``), which on
  a CPU is several times slower than the same op repeated on one cache-resident buffer; the H100
  and H200 presets take what elementwise ops achieved on an H100 (88% of the datasheet's).
* ``eff(F)``: achievable fraction of peak; large GEMMs reach ~70-80% of dense peak on A100/H100
  (e.g. NVIDIA's Megatron-LM reports 163-173 TFLOP/s of 312 on A100, ~55%, for whole models;
  cuBLAS GEMMs at large sizes reach 70-80%; on one H100, with ``EFF_MAX`` left free per dtype,
  the fit of ``autopar/tools/op_reference.py`` gives 0.756 bf16 and 0.738 fp32 from
  ``cost_model/reference/h100_ops.jsonl``), small ones far less. Modeled as
  ``eff = EFF_MAX * F / (F + peak * T_HALF) * d / (d + D)``, which falls for small ops (an op
  that would take ``T_HALF`` seconds at peak reaches half of EFF_MAX, so tiny ops cost about
  ``T_HALF / EFF_MAX``) and for skinny GEMMs: ``d`` is the smallest of the local GEMM's ``m``,
  ``k``, ``n`` (``gemm_min_dim``; the forward and both backward GEMMs of a matmul share these
  three sizes), ``D`` is ``device.matmul_dim_half`` (0: no such loss; fitted by ``autopar
  calibrate``, ``calibrate_compute.matmul_figures``).
* ``o``: for a matmul, ``device.matmul_overhead_s``: a GEMM's fixed seconds beyond ``launch``
  (packing its operands, the autograd of a matmul), which small GEMMs feel (fitted by ``autopar
  calibrate`` with ``D``). 0 for other ops.
* ``p_fwd(op)``, ``p_bwd(op)``: seconds per unit ``U`` of the op's forward and backward where the
  device measured them (``autopar calibrate``): per element of the op's largest tensor
  (``U = E``, ``DeviceSpec.pointwise_s``) for ops bound by their arithmetic, which no FLOP count
  sees (a CPU's ``tanh`` costs an order of magnitude more per element than an ``add``);
  per forward FLOP (``U = F``, ``DeviceSpec.per_flop_s``) for ops that run far from the matmul
  rate (``scaled_dot_product_attention`` on a CPU). 0 where not measured.
* ``g``: how many of the op's inputs get a *new* gradient tensor (``NodeInfo.grad_new``, from the
  op's real backward): a matmul's backward is two matmuls of the forward's size (grad input, grad
  weight: ``g = 2``), an elementwise op's writes one gradient per input it computes one for, an
  ``add`` passes its output's gradient on (``g = 0``: its backward is one autograd node, ``launch``).
* ``G``: bytes a backward moves whatever its arithmetic: the output's gradient read once and each
  new input gradient written once. It is what a view that drops elements costs backward (a slice's
  gradient is a zero-filled tensor of the input's size with the output's gradient copied in; a
  ``select``, ``index`` or ``expand`` likewise), where ``M`` (0 for a view) sees nothing.
* ``launch``: per-op fixed cost (kernel launch, dispatch, autograd node), ``device.kernel_launch_s``,
  charged once forward and once backward.

An optimizer's step over one parameter tensor of ``P`` bytes streams the bytes of the kernels
PyTorch's default implementation runs (``torch.optim``: per tensor on CPUs, ``foreach`` on GPUs,
the same kernels; ``OPTIMIZER_TRAFFIC``), plus a fixed cost per tensor (``device.optimizer_param``:
the ops it launches, measured by ``autopar calibrate``):

    t_opt = P * (a / bw_inplace + f / bw) + o(optimizer)                                    [s]

with ``a`` the passes over ``P`` bytes of the kernels that update a tensor in place (at
``device.inplace_bw``) and ``f`` those of the kernels that write a fresh temporary (at ``bw``):

* SGD: ``param.add_(grad)``, a = 3 (read the parameter and the gradient, write the parameter);
* SGD with momentum: ``buf.mul_(m).add_(grad)``, ``param.add_(buf)``: a = 2 + 3 + 3 = 8;
* Adam: ``exp_avg.lerp_(grad)`` 3, ``exp_avg_sq.mul_(b2)`` 2 ``.addcmul_(grad, grad)`` 3,
  ``denom = (exp_avg_sq.sqrt() / c2).add_(eps)`` 2 + 2 fresh and 2 in place,
  ``param.addcdiv_(exp_avg, denom)`` 4: a = 14, f = 4, where a fused kernel would move 7 (the
  kernels' own count, from ``torch/optim/adam.py``'s ``_single_tensor_adam``; checked against
  a timed Adam step in ``benchmarks/README.md``).
  Its two temporaries of ``P`` bytes are live at once (``optimizer_step_bytes``).

and a step pays ``device.step_overhead_s`` once (``backward()``'s engine start, ``step()`` and
``zero_grad()`` as Python calls; added to the plan's step time by ``passes/price.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from autopar.cluster import DeviceSpec

EFF_MAX = 0.75
T_HALF = 2e-6  # seconds-at-peak at which a kernel reaches half of EFF_MAX
BACKWARD_FACTOR = 2.0  # backward / forward work of an op with two (or more) new input gradients


def skinny_factor(min_dim: float | None, device: DeviceSpec) -> float:
    """``d / (d + D)`` of the module docstring (1 when ``d`` is unknown or ``D`` is 0)."""
    half = device.matmul_dim_half
    if not min_dim or half <= 0:
        return 1.0
    return min_dim / (min_dim + half)


def forward_body(
    flops: float,
    nbytes: float,
    dtype: torch.dtype | None,
    device: DeviceSpec,
    k: float = 1,
    min_dim: float | None = None,
) -> float:
    """The roofline part of one rank's forward (no launch, no pointwise table) [s]; ``min_dim``:
    the smallest size of the local GEMM, for a matmul (``gemm_min_dim``), which also pays
    ``device.matmul_overhead_s``."""
    f = flops / k
    m = nbytes / k
    t_flops = 0.0
    if f > 0:
        peak = device.peak_flops_for(dtype or torch.float32)
        # = f / (peak * eff(f)), without 0 / 0
        t_flops = (f + peak * T_HALF) / (peak * EFF_MAX * skinny_factor(min_dim, device))
        if min_dim is not None:
            t_flops += device.matmul_overhead_s
    t_mem = m / device.memory_bandwidth
    return max(t_flops, t_mem)


# matmul-family aten ops -> (m, k, n) of the GEMM from their tensor inputs' shapes
def _mm(a, b):
    return a[0], a[1], b[1]


def _linear(x, w, *_):
    return math.prod(x[:-1]), x[-1], w[0]


def _batched(a, b, *_):
    return (a[-2] if len(a) > 1 else 1), a[-1], (b[-1] if len(b) > 1 else 1)


_GEMMS = {
    "aten.mm.default": _mm,
    "aten.addmm.default": lambda bias, a, b: _mm(a, b),
    "aten.linear.default": _linear,
    "aten.bmm.default": _batched,
    "aten.baddbmm.default": lambda bias, a, b: _batched(a, b),
    "aten.matmul.default": _batched,
    # the output projection fused with its loss (kernels/cross_entropy.py): h [N, H] @ W[V, H]^T
    "autopar.linear_cross_entropy.default": lambda h, w, *_: (h[0], h[1], w[0]),
    # a mixture of experts' grouped GEMMs (kernels/moe.py): per local expert, its share of the
    # routed rows (balanced) against [H, F]: x [T, H], ids [T, k], w_in [E, F, H] or [E, H, F]
    "autopar.moe_experts.default": lambda x, w, ids, w_in, *_: (x[0] * ids[1] / w_in[0], x[1], min(w_in[1:])),
}

# the matmul-family ops, as a plan's decisions name them (``autopar/report/parts.py`` reads them)
GEMM_OPS = frozenset(_GEMMS)

# ops whose backward runs more GEMMs of the forward's size than the two of a matmul: the fused
# cross-entropy recomputes each chunk's logits before its two gradient GEMMs (it keeps no logits)
BACKWARD_GEMMS = {"autopar.linear_cross_entropy.default": 3}


def gemm_min_dim(op: str, shapes: Sequence[Sequence[int]]) -> int | None:
    """The smallest of ``m``, ``k``, ``n`` of the GEMM that matmul-family ``op`` (``str`` of the aten
    overload) runs on tensor inputs of these (local) ``shapes``; None for other ops."""
    fn = _GEMMS.get(op)
    if fn is None:
        return None
    try:
        return int(min(fn(*shapes)))
    except (IndexError, TypeError, ValueError):
        return None


def node_time(
    flops: float,
    nbytes: float,
    dtype: torch.dtype | None,
    device: DeviceSpec,
    k: float,
    requires_grad: bool,
    *,
    new_grads: int = 2,
    op: str = "",
    elements: float = 0.0,
    grad_bytes: float = 0.0,
    min_dim: float | None = None,
) -> float:
    """Forward + backward seconds of one node on one rank (see the module docstring);
    ``grad_bytes`` is ``G``, ``min_dim`` the local GEMM's ``d`` for a matmul."""
    body = forward_body(flops, nbytes, dtype, device, k, min_dim)
    units, measured = elements, device.pointwise(op) if op else None
    if op and measured is None and flops > 0:
        units, measured = flops, device.per_flop(op)
    fwd = max(body, units / k * measured[0]) if measured else body
    t = fwd + device.kernel_launch_s
    if requires_grad:
        factor = BACKWARD_GEMMS.get(op, min(new_grads, BACKWARD_FACTOR))
        bwd = max(factor * body, grad_bytes / k / device.memory_bandwidth)
        if measured:
            bwd = max(bwd, units / k * measured[1])
        t += bwd + device.kernel_launch_s
    return t


def accumulate_time(nbytes: float, uses: int, device: DeviceSpec) -> float:
    """Seconds backward spends summing the gradients of a tensor of ``nbytes`` (local) that
    ``uses`` consumers send one each: ``uses - 1`` additions, each reading two and writing one:

        t_acc = (uses - 1) * (3 * nbytes / bw + launch)                                   [s]
    """
    if uses <= 1:
        return 0.0
    return (uses - 1) * (3 * nbytes / device.memory_bandwidth + device.kernel_launch_s)


# optimizer (``passes.costs.Optimizer`` name) -> (passes in place, passes to fresh temporaries,
# temporaries of the parameter's size live at once) over one parameter's bytes in PyTorch's default
# step (module docstring)
OPTIMIZER_TRAFFIC: dict[str, tuple[int, int, int]] = {
    "SGD": (3, 0, 0),
    "SGD_MOMENTUM": (8, 0, 0),
    "ADAM": (14, 4, 2),
}


def _traffic(state_copies: int, optimizer: str) -> tuple[int, int, int]:
    # an optimizer not in the table: read the parameter, its gradient and states, write them back
    return OPTIMIZER_TRAFFIC.get(optimizer, (2 + 2 * state_copies + 1, 0, 0))


def optimizer_step_time(
    param_bytes: float, state_copies: int, device: DeviceSpec, optimizer: str = ""
) -> float:
    """``t_opt`` of the module docstring [s] for one parameter tensor (``optimizer``: an
    ``Optimizer`` name; one launch per tensor where the device has no figure for it)."""
    inplace, fresh, _ = _traffic(state_copies, optimizer)
    return param_bytes * (
        inplace / device.inplace_bw + fresh / device.memory_bandwidth
    ) + device.optimizer_param(optimizer)


# a CPU optimizer's own time per tensor (no kernel launch: Python and ATen dispatch), an assumption
HOST_OPTIMIZER_PARAM_S = 5e-6


def host_optimizer_step_time(
    param_bytes: float, state_copies: int, bandwidth: float, optimizer: str = ""
) -> float:
    """``optimizer_step_time`` of one parameter tensor stepped on the host (offloaded): the same
    memory traffic at the host memory's ``bandwidth`` [B/s] (``ClusterSpec.host_step_bandwidth``)."""
    inplace, fresh, _ = _traffic(state_copies, optimizer)
    return param_bytes * (inplace + fresh) / bandwidth + HOST_OPTIMIZER_PARAM_S


def optimizer_step_bytes(param_bytes: float, optimizer: str) -> float:
    """Bytes of temporaries the step of one parameter tensor of ``param_bytes`` holds at once
    (Adam's ``sqrt`` and the division of it: twice the parameter), freed before the next tensor's."""
    return param_bytes * OPTIMIZER_TRAFFIC.get(optimizer, (0, 0, 0))[2]


# -- FP8 linears ----------------------------------------------------------------------------------
FLOAT8 = torch.float8_e4m3fn


def float8_peak_dtype(device: DeviceSpec, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype whose peak an FP8 linear's GEMMs run at: ``float8_e4m3fn`` where the device lists
    an FP8 rate (``DeviceSpec.float8_flops``), else the linear's own (a device without FP8 tensor
    cores runs the scaled matmul no faster: torch emulates it, or the kernel upcasts)."""
    return FLOAT8 if device.float8_flops else (dtype or torch.float32)


def float8_linear_time(
    flops: float,
    dtype: torch.dtype | None,
    device: DeviceSpec,
    k: float,
    requires_grad: bool,
    casts: Sequence[tuple[float, bool]],
    *,
    new_grads: int = 2,
    min_dim: float | None = None,
    bias_elements: float = 0.0,
) -> float:
    """Forward + backward seconds of one linear run FP8 on one rank (``autopar/lowerings/float8.py``):

        t = node_time(F, M8, fp8) + sum_casts ((2 item + 1) E_c / bw + 2 launch) + t_bias     [s]

    * the three GEMMs at the device's FP8 peak (``float8_peak_dtype``) with the same efficiency
      curve as any matmul (``forward_body``: ``EFF_MAX``, ``T_HALF``, ``matmul_dim_half``), moving
      ``M8``: one byte per operand element, the output in ``item`` bytes;
    * each cast ``c`` (``casts``: its local elements ``E_c`` and whether it runs in backward, which
      counts only when the linear needs gradients) reads its operand twice in the high type (amax,
      then scale and cast) and writes one byte per element, at ``memory_bandwidth``, two launches;
    * ``t_bias``: torchao adds a bias after the scaled matmul, one elementwise pass (read two,
      write one) forward and a row sum of the output's gradient backward.

    The amax all-reduces are collectives, priced by the comm model (``passes/costs.py``)."""
    item = torch.empty((), dtype=dtype or torch.float32).element_size()
    x_el = casts[0][0] if casts else 0.0
    w_el = casts[1][0] if len(casts) > 1 else 0.0
    y_el = casts[2][0] if len(casts) > 2 else 0.0
    gemm_bytes = (x_el + w_el) + y_el * item  # local already
    t = node_time(
        flops, gemm_bytes * k, float8_peak_dtype(device, dtype), device, k, requires_grad,
        new_grads=new_grads, op="aten.linear.default", min_dim=min_dim,
    )  # fmt: skip
    bw = device.memory_bandwidth
    for elements, backward in casts:
        if backward and not requires_grad:
            continue
        t += (2 * item + 1) * elements / bw + 2 * device.kernel_launch_s
    if bias_elements:
        t += 3 * item * bias_elements / bw + device.kernel_launch_s
        if requires_grad:
            t += item * bias_elements / bw + device.kernel_launch_s
    return t
