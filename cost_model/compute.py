"""Compute costs in seconds: a roofline per op, forward and backward.

For one node run on a rank that does ``1/k`` of the work (``k`` = product of the mesh axes the
strategy splits the op over):

    t_fwd = max(F / k / (peak(dtype) * eff(F)), M / k / mem_bw) + launch        [s]
    t_bwd = 2 * t_fwd  (when the output needs a gradient)                        [s]

* ``F``: forward FLOPs of the global op (torch.utils.flop_counter); ``M``: bytes moved (inputs +
  outputs); ``peak(dtype)``: dense peak FLOP/s of the device for the op's dtype (ClusterSpec
  presets, datasheet figures); ``mem_bw``: device memory bandwidth in B/s.
* ``eff(F)``: achievable fraction of peak; large GEMMs reach ~70-80% of dense peak on A100/H100
  (e.g. NVIDIA's Megatron-LM reports 163-173 TFLOP/s of 312 on A100, ~55%, for whole models;
  cuBLAS GEMMs at large sizes reach 70-80%), small ones far less. Modeled as
  ``eff = EFF_MAX * F / (F + peak * T_HALF)``, which falls for small ops: an op that would take
  ``T_HALF`` seconds at peak reaches half of EFF_MAX (so tiny ops cost about ``T_HALF / EFF_MAX``).
* ``launch``: per-op fixed cost (kernel launch / Python dispatch), ``device.kernel_launch_s``.
* Backward = 2x forward: a matmul's backward is two matmuls of the same size (grad input, grad
  weight); elementwise backward reads the output gradient and the saved input and writes a grad.
"""

from __future__ import annotations

import torch

from autopar.cluster import DeviceSpec

EFF_MAX = 0.75
T_HALF = 2e-6  # seconds-at-peak at which a kernel reaches half of EFF_MAX
BACKWARD_FACTOR = 2.0


def forward_time(
    flops: float, nbytes: float, dtype: torch.dtype | None, device: DeviceSpec, k: float = 1
) -> float:
    f = flops / k
    m = nbytes / k
    t_flops = 0.0
    if f > 0:
        peak = device.peak_flops_for(dtype or torch.float32)
        eff = EFF_MAX * f / (f + peak * T_HALF)
        t_flops = f / (peak * eff)
    t_mem = m / device.memory_bandwidth
    return max(t_flops, t_mem) + device.kernel_launch_s


def node_time(
    flops: float, nbytes: float, dtype: torch.dtype | None, device: DeviceSpec, k: float, requires_grad: bool
) -> float:
    """Forward + backward seconds of one node on one rank."""
    t = forward_time(flops, nbytes, dtype, device, k)
    return t * (1 + BACKWARD_FACTOR) if requires_grad else t


def optimizer_step_time(param_bytes: float, state_copies: int, device: DeviceSpec) -> float:
    """An elementwise optimizer reads param + grad + states and writes param + states: memory-bound."""
    moved = param_bytes * (2 + 2 * state_copies + 1)
    return moved / device.memory_bandwidth + device.kernel_launch_s
