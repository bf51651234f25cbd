"""Preset devices and nodes (``ClusterSpec.preset``), each number with its source.

Presets (``ClusterSpec.preset``): ``a100-40gb``, ``a100-80gb``, ``h100-sxm``, ``h100-96gb``,
``h200``, ``b200`` (each of ``DeviceKind.CUDA``), ``cpu`` (``DeviceKind.CPU``).

Sources (numbers are repeated with their source next to each value below)
-------------------------------------------------------------------------
* [A100-DS] NVIDIA A100 Tensor Core GPU datasheet (SXM column), nvidia.com/a100:
  FP32 19.5 TFLOPS, TF32 156 TFLOPS, BF16/FP16 312 TFLOPS (dense), 40 GB HBM2 at 1,555 GB/s,
  80 GB HBM2e at 2,039 GB/s, NVLink (3rd gen) 600 GB/s, PCIe Gen4 64 GB/s (32 GB/s per direction).
* [H100-DS] NVIDIA H100 Tensor Core GPU datasheet (SXM column), nvidia.com/h100: FP32 67 TFLOPS,
  BF16/FP16 1,979 TFLOPS *with sparsity* = 989 TFLOPS dense, FP8 3,958 with sparsity = 1,979 dense,
  80 GB HBM3 at 3.35 TB/s, NVLink (4th gen) 900 GB/s, PCIe Gen5 128 GB/s (64 GB/s per direction).
* [H200-DS] NVIDIA H200 product page / datasheet, nvidia.com/h200: same Tensor Core throughput as
  H100 SXM, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5.
* [GT-H100] torchtitan's ``docs/performance.md`` (pytorch/torchtitan), the Grand Teton platform its
  H100 benchmarks ran on: 8 H100 per host fully connected with NVLink, each with 96 GB of HBM2e at
  2.4 TB/s peak, 400 Gb/s of RDMA per GPU between hosts, at the default 500 W power limit (the
  SXM's TDP is 700 W). The same H100 with HBM2e is measured at 94 GiB and 2.41 TB/s in "Architectural
  and Power-Capping Trade-offs in NVIDIA H100 and H200 GPUs" (arXiv 2604.11391). No datasheet gives
  the tensor-core rate at 500 W: the preset keeps the SXM's [H100-DS] peaks, so a power-capped run
  is priced fast by however much the cap slows its GEMMs.
* [B200-DS] NVIDIA DGX B200 datasheet and HGX B200 specifications (nvidia.com/dgx-b200): per GPU
  (the 8-GPU figures divided by 8) 180 GB of HBM3e (1,440 GB) at 8 TB/s (64 TB/s), FP8 Tensor Core
  9 PFLOPS with sparsity (72) = 4.5 dense, FP16/BF16 4.5 PFLOPS with sparsity (36) = 2.25 dense,
  FP32 75 TFLOPS (600), fifth-generation NVLink 1.8 TB/s per GPU (14.4 TB/s), 8 single-port
  ConnectX-7 at 400 Gb/s, 2 TB of system memory (up to 4), PCIe Gen5.
* [NCCL-TESTS] github.com/NVIDIA/nccl-tests (doc/PERFORMANCE.md defines "bus bandwidth"); published
  all_reduce_perf runs on 8-GPU DGX A100 reach ~230-240 GB/s busbw, on DGX H100 ~360-480 GB/s.
* [IB] InfiniBand HDR = 200 Gb/s = 25 GB/s per port, NDR = 400 Gb/s = 50 GB/s per port; DGX A100
  ships 1 HDR port per GPU, DGX H100/H200 one NDR port per GPU (DGX user guides). MPI/NCCL small-
  message latency over IB is a few microseconds.
* [DGX] DGX A100 system memory 1 TB (320 GB system) / 2 TB (640 GB system); DGX H100 and DGX H200
  system memory 2 TB (NVIDIA DGX datasheets).
* [H100-OPS] ``cost_model/reference/h100_ops.jsonl`` (README there): single-op times measured on
  one NVIDIA H100 80GB HBM3 (132 SMs), torch 2.11.0+cu130, CUDA events, median: matmuls, attention,
  elementwise ops, norms, softmax, cross-entropy, Adam steps. The ``h100-sxm`` and ``h200`` figures
  marked with it are fitted by ``autopar/tools/op_reference.py:fit_figures`` (a few figures through
  the cost model's own formulas, not one per row; ``benchmarks/bench_gpu_preset.py --fit`` prints
  them, ``tests/test_gpu_preset.py`` holds these values to it). The dense peaks stay the
  datasheet's: ``cost_model.compute.EFF_MAX`` (0.75) accounts for the achievable fraction, and
  the file agrees (0.756 bf16, 0.738 fp32 when fitted free). One card on one day: the figures cite
  it, they do not reproduce each row (what they give per op family: ``benchmarks/README.md``, "H100
  preset against measured ops").
* [CUDA-LAUNCH] CUDA kernel launch overhead is a few microseconds (NVIDIA CUDA best-practices guide
  and common micro-benchmarks: ~3-5 us).
* [OVERLAP] How much of an NCCL collective hides behind concurrent GEMMs has no datasheet figure.
  Published bounds: an H100 GEMM sized to one wave of 132 SMs nearly doubles in time next to a
  24-block NCCL all-gather (NVIDIA developer forum, "Compute-communication overlap causes severe
  GEMM performance degradation because of tail effect", 2025: efficiency near 0 in that worst
  case); arXiv 2606.09200 (Resource-aware computation-communication overlap, A100/H100/MI250X)
  gets up to 25.5% lower total time only after reshaping kernel occupancy and stream priorities,
  i.e. stock overlap is partial. GPU presets take 0.5, between those bounds; ``autopar
  calibrate`` measures a cluster's own (``cost_model/overlap.py``).
* ``cpu`` preset: modest numbers for one CPU training process (one core); its ranks share the
  host's cores, which only this device kind models (``DeviceSpec.contention``, a
  ``HostContention`` with ``host_cores`` the cores this process may run on,
  ``usable_cores()``: ``os.sched_getaffinity``, and no sync wait until calibrated). Its loopback
  gloo link is of the order ``autopar calibrate`` fits for a few ranks on one host (collectives
  cost about a millisecond); 10 GbE = 1.25 GB/s between hosts. Its figures are round defaults,
  not one machine's: run ``autopar calibrate`` for your own (what it gave on the development
  machine: ``benchmarks/README.md``, "Readings of the development VM"). No GPU preset carries a
  contention model or calibrated link ranges.
"""

from __future__ import annotations

import dataclasses

from autopar.hardware import (
    DEFAULT_KERNEL_LAUNCH_S,
    DeviceKind,
    DeviceSpec,
    GiB,
    HostContention,
    LinkSpec,
    TiB,
    usable_cores,
)

__all__ = ["PRESET_NAMES"]


# --------------------------------------------------------------------------------------------------
# presets (numbers with their source; see module docstring for the full references)
# --------------------------------------------------------------------------------------------------

_GPU_OVERLAP = 0.5  # [OVERLAP] fraction of the ideal gradient all-reduce / backward overlap realized
_NVLINK_LATENCY = 3e-6  # [NCCL-TESTS] small-message NVLink/NVSwitch latency, a few us
_IB_LATENCY = 5e-6  # [IB] small-message InfiniBand latency, a few us
_PCIE_LATENCY = 10e-6  # small cudaMemcpy host<->device latency, ~10 us (common micro-benchmarks)

_A100_FLOPS = {
    "float32": 19.5e12,  # [A100-DS] FP32 19.5 TFLOPS (TF32 tensor cores: 156 TFLOPS, not assumed here)
    "bfloat16": 312e12,  # [A100-DS] BF16 Tensor Core 312 TFLOPS dense
    "float16": 312e12,  # [A100-DS] FP16 Tensor Core 312 TFLOPS dense
}
_H100_FLOPS = {
    "float32": 67e12,  # [H100-DS] FP32 67 TFLOPS (SXM)
    "bfloat16": 989e12,  # [H100-DS] BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989 dense
    "float16": 989e12,  # [H100-DS] FP16 Tensor Core 1,979 TFLOPS with sparsity -> 989 dense
    "float8_e4m3fn": 1979e12,  # [H100-DS] FP8 Tensor Core 3,958 TFLOPS with sparsity -> 1,979 dense
}

# [H100-OPS] figures fitted to one H100's measured ops (torch 2.11+cu130; see the module docstring).
# The H200 has the H100 SXM's SMs and clocks [H200-DS], so it takes the same figures, all but its
# memory bandwidth (below).
_ACHIEVED_BW_FRACTION = 2.96 / 3.35  # [H100-OPS] of [H100-DS]: what elementwise ops reach of a datasheet
_H100_ACHIEVED_BW = 2.96e12  # [H100-OPS] t = L + B / bw over elementwise ops: 2.96 TB/s of the 3.35 [H100-DS]
_H100_FITTED = dict(
    # [H100-OPS] the launch floor L of the same fit (an elementwise op of 64 Ki elements: ~5 us)
    kernel_launch_s=5.04e-6,
    # [H100-OPS] matmuls at the datasheet peak x EFF_MAX: the smallest GEMM size of half speed
    # (matmul_dim_half) and the fixed cost per GEMM beyond the launch (matmul_overhead_s) of least
    # squared relative error over the bf16 and fp32 mm rows
    matmul_dim_half=16.0,
    matmul_overhead_s=0.0,
    # [H100-OPS] seconds per element (forward, backward) of ops slower than their bytes at the
    # achieved bandwidth, fitted on rows of >= 2^24 elements: layer_norm / rms_norm ~2.1 TB/s,
    # softmax ~1.3 TB/s in bf16, cross-entropy (log-softmax + gather) ~0.6 TB/s in bf16; backward
    # 0: the roofline (only cross-entropy's was measured)
    pointwise_s={
        "aten.cross_entropy_loss.default": (2.61e-12, 2.62e-12),
        "aten.layer_norm.default": (1.73e-12, 0.0),
        "aten.rms_norm.default": (1.83e-12, 0.0),
        "aten.softmax.int": (3.18e-12, 0.0),
    },
    # [H100-OPS] Adam (torch's default foreach step) per parameter tensor of 2^22 elements beyond
    # its bytes at the achieved bandwidth
    optimizer_param_s={"ADAM": 1.13e-5},
)

# A100 nodes (DGX A100): NVLink3 600 GB/s total per GPU [A100-DS]; achievable all-reduce bus bandwidth
# measured by nccl-tests on 8x A100 is ~240 GB/s [NCCL-TESTS] -> 240e9 B/s.
_A100_NVLINK = LinkSpec(bandwidth=240e9, latency=_NVLINK_LATENCY)
# A100 clusters typically use InfiniBand HDR 200 Gb/s per GPU = 25e9 B/s [IB].
_HDR_IB = LinkSpec(bandwidth=25e9, latency=_IB_LATENCY)
# PCIe Gen4 x16: 32 GB/s per direction theoretical [A100-DS], ~25 GB/s achievable.
_PCIE4 = LinkSpec(bandwidth=25e9, latency=_PCIE_LATENCY)

# H100/H200 nodes (DGX H100/H200): NVLink4 900 GB/s total per GPU [H100-DS]; nccl-tests all-reduce
# bus bandwidth on 8x H100 is ~360-480 GB/s [NCCL-TESTS] -> 450e9 B/s.
_H100_NVLINK = LinkSpec(bandwidth=450e9, latency=_NVLINK_LATENCY)
# B200 nodes (DGX B200): NVLink5 1.8 TB/s per GPU [B200-DS]; no nccl-tests figure here: the bus
# bandwidth the H100 reaches of its NVLink, 450 / 900 [NCCL-TESTS], of the B200's -> 900e9 B/s.
_B200_NVLINK = LinkSpec(bandwidth=900e9, latency=_NVLINK_LATENCY)
# InfiniBand NDR 400 Gb/s per GPU = 50e9 B/s [IB].
_NDR_IB = LinkSpec(bandwidth=50e9, latency=_IB_LATENCY)
# PCIe Gen5 x16: 64 GB/s per direction theoretical [H100-DS], ~50 GB/s achievable.
_PCIE5 = LinkSpec(bandwidth=50e9, latency=_PCIE_LATENCY)

_DEVICES: dict[str, DeviceSpec] = {
    "a100-40gb": DeviceSpec(
        name="NVIDIA A100-SXM4-40GB",
        kind=DeviceKind.CUDA,
        peak_flops=_A100_FLOPS,
        memory_bytes=40 * GiB,  # [A100-DS] 40 GB HBM2
        memory_bandwidth=1555e9,  # [A100-DS] 1,555 GB/s
        kernel_launch_s=DEFAULT_KERNEL_LAUNCH_S,  # [CUDA-LAUNCH]
        comm_overlap=_GPU_OVERLAP,  # [OVERLAP]
    ),
    "a100-80gb": DeviceSpec(
        name="NVIDIA A100-SXM4-80GB",
        kind=DeviceKind.CUDA,
        peak_flops=_A100_FLOPS,
        memory_bytes=80 * GiB,  # [A100-DS] 80 GB HBM2e
        memory_bandwidth=2039e9,  # [A100-DS] 2,039 GB/s
        kernel_launch_s=DEFAULT_KERNEL_LAUNCH_S,  # [CUDA-LAUNCH]
        comm_overlap=_GPU_OVERLAP,  # [OVERLAP]
    ),
    "h100-sxm": DeviceSpec(
        name="NVIDIA H100 80GB HBM3",
        kind=DeviceKind.CUDA,
        peak_flops=_H100_FLOPS,
        memory_bytes=80 * GiB,  # [H100-DS] 80 GB HBM3
        memory_bandwidth=_H100_ACHIEVED_BW,  # [H100-OPS] achieved; the datasheet's 3.35 TB/s [H100-DS]
        comm_overlap=_GPU_OVERLAP,  # [OVERLAP]
        **_H100_FITTED,  # [H100-OPS]
    ),
    "h200": DeviceSpec(
        name="NVIDIA H200",
        kind=DeviceKind.CUDA,
        peak_flops=_H100_FLOPS,  # [H200-DS] same compute as H100 SXM
        memory_bytes=141 * GiB,  # [H200-DS] 141 GB HBM3e
        # [H200-DS] 4.8 TB/s x the fraction of its datasheet the H100 achieved, 2.96 / 3.35 [H100-OPS]
        # (no H200 was measured)
        memory_bandwidth=4.24e12,
        comm_overlap=_GPU_OVERLAP,  # [OVERLAP]
        **_H100_FITTED,  # [H100-OPS] the H100's SMs and clocks [H200-DS]
    ),
    "h100-96gb": DeviceSpec(
        name="NVIDIA H100 96GB HBM2e",
        kind=DeviceKind.CUDA,
        peak_flops=_H100_FLOPS,  # [GT-H100] the SXM's peaks [H100-DS]; its 500 W cap is not priced
        memory_bytes=94 * GiB,  # [GT-H100] 96 GB HBM2e, 94 GiB as measured
        # [GT-H100] 2.4 TB/s x the fraction of its datasheet the H100 achieved [H100-OPS]
        memory_bandwidth=2.4e12 * _ACHIEVED_BW_FRACTION,
        comm_overlap=_GPU_OVERLAP,  # [OVERLAP]
        **_H100_FITTED,  # [H100-OPS] the H100's SMs and clocks
    ),
    "b200": DeviceSpec(
        name="NVIDIA B200",
        kind=DeviceKind.CUDA,
        peak_flops={
            "float32": 75e12,  # [B200-DS] FP32 600 TFLOPS per 8 GPUs
            "bfloat16": 2250e12,  # [B200-DS] BF16 4.5 PFLOPS with sparsity -> 2.25 dense
            "float16": 2250e12,  # [B200-DS] FP16 likewise
            "float8_e4m3fn": 4500e12,  # [B200-DS] FP8 9 PFLOPS with sparsity -> 4.5 dense
        },
        memory_bytes=180 * GiB,  # [B200-DS] 1,440 GB per 8 GPUs
        # [B200-DS] 8 TB/s x the fraction of its datasheet the H100 achieved [H100-OPS] (no B200 was
        # measured)
        memory_bandwidth=8e12 * _ACHIEVED_BW_FRACTION,
        comm_overlap=_GPU_OVERLAP,  # [OVERLAP]
        # [H100-OPS] no B200 was measured: the H100's launch floor, GEMM shape losses and per-element
        # figures, as the nearest card measured
        **_H100_FITTED,
    ),
    "cpu": DeviceSpec(
        name="cpu",
        kind=DeviceKind.CPU,
        peak_flops={"float32": 50e9},  # conservative: one process on one core, ~50 GFLOP/s fp32
        memory_bytes=8 * GiB,  # RAM budget per process
        memory_bandwidth=20e9,  # conservative share of a DDR4/DDR5 socket's bandwidth
        kernel_launch_s=10e-6,  # an eager CPU op (dispatch + autograd node), forward or backward
        # gloo's threads compete with the ranks for cores, so little of an all-reduce hides behind
        # compute; 0 prices overlapped all-reduces as inline (`autopar calibrate` measures it)
        comm_overlap=0.0,
        # ranks share the host's cores; host_cores is filled in per host (_cpu_device)
        contention=HostContention(),
    ),
}

# (intra_node, inter_node, host_memory_bytes per node, host_link, default devices_per_node,
#  host_memory_bandwidth per node: two sockets' DRAM at ~75% of its channels' peak, STREAM's usual share)
_NODES: dict[str, tuple[LinkSpec, LinkSpec, int, LinkSpec, int, float | None]] = {
    # [DGX] DGX A100: 2 x AMD EPYC 7742, 8 channels of DDR4-3200 each (2 x 204.8 GB/s peak)
    "a100-40gb": (_A100_NVLINK, _HDR_IB, 1 * TiB, _PCIE4, 8, 300e9),  # [DGX] DGX A100 320GB: 1 TB RAM
    "a100-80gb": (_A100_NVLINK, _HDR_IB, 2 * TiB, _PCIE4, 8, 300e9),  # [DGX] DGX A100 640GB: 2 TB RAM
    # [DGX] DGX H100/H200: 2 x Xeon Platinum 8480C, 8 channels of DDR5-4800 each (2 x 307 GB/s peak)
    "h100-sxm": (_H100_NVLINK, _NDR_IB, 2 * TiB, _PCIE5, 8, 460e9),  # [DGX] DGX H100: 2 TB RAM
    "h200": (_H100_NVLINK, _NDR_IB, 2 * TiB, _PCIE5, 8, 460e9),  # [DGX] DGX H200: 2 TB RAM
    # [GT-H100] Grand Teton: NVLink within the host, 400 Gb/s RDMA per GPU between hosts (its
    # host memory and CPUs are not given there: a DGX H100's)
    "h100-96gb": (_H100_NVLINK, _NDR_IB, 2 * TiB, _PCIE5, 8, 460e9),
    # [B200-DS] DGX B200: 2 x Xeon Platinum 8570, 2 TB RAM, 400 Gb/s ConnectX-7 per GPU, PCIe Gen5
    "b200": (_B200_NVLINK, _NDR_IB, 2 * TiB, _PCIE5, 8, 460e9),
    "cpu": (
        # gloo over loopback TCP: about a GB/s and a millisecond per collective, the order
        # `autopar calibrate` fits for a few ranks on one host (runs: benchmarks/README.md)
        LinkSpec(bandwidth=1e9, latency=1e-3),
        LinkSpec(bandwidth=1.25e9, latency=50e-6),  # 10 GbE = 1.25e9 B/s, TCP latency ~50 us
        32 * GiB,  # 4 processes x 8 GiB
        LinkSpec(bandwidth=20e9, latency=1e-6),  # "offload" is a memcpy in the same RAM
        4,  # CPU "devices" are processes
        None,  # the host is the device: its own memory bandwidth (ClusterSpec.preset)
    ),
}

PRESET_NAMES: tuple[str, ...] = tuple(_DEVICES)


def _cpu_device() -> DeviceSpec:
    """The ``cpu`` preset's device for ranks on this host: they share its ``usable_cores()``."""
    base = _DEVICES["cpu"]
    return base.with_contention(host_cores=usable_cores())


def _gpu_preset_for(gpu_name: str, total_memory: int) -> str:
    """Closest GPU preset for a CUDA device name ("A100" + memory size, "H100", "H200"); else h100-sxm."""
    upper = gpu_name.upper()
    if "H200" in upper:
        return "h200"
    if "B200" in upper:
        return "b200"
    if "H100" in upper:
        # the 96 GB HBM2e part (Grand Teton's), not the NVL's 94 GB of HBM3
        return "h100-96gb" if total_memory >= 90 * GiB and "NVL" not in upper else "h100-sxm"
    if "A100" in upper:
        return "a100-80gb" if total_memory > 60 * GiB else "a100-40gb"
    return "h100-sxm"  # unknown GPU: modern-GPU numbers, with the real memory size


def _gpu_device(gpu_name: str, total_memory: int) -> DeviceSpec:
    """The closest GPU preset's device, with the real device name and memory size."""
    base = _DEVICES[_gpu_preset_for(gpu_name, total_memory)]
    return dataclasses.replace(base, name=gpu_name or base.name, memory_bytes=total_memory)
