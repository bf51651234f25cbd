"""Description of a training cluster, as data for the analytical cost model.

Units everywhere: seconds (s), bytes (B), FLOP/s, bytes/s (B/s). All classes are frozen (hashable)
dataclasses validated on construction; an invalid value raises
:class:`autopar.errors.ClusterSpecError` naming the field, the bad value and what is allowed.

Fields
------
:class:`LinkSpec` -- one kind of point-to-point/collective link, priced as ``latency + bytes / bandwidth``:

* ``bandwidth``: achievable bandwidth in B/s (> 0). For GPU interconnects this is the *bus bandwidth*
  an NCCL all-reduce reaches (as reported by nccl-tests), not the marketing total.
* ``latency``: fixed per-message cost in s (>= 0).

:class:`DeviceSpec` -- one accelerator (or one CPU process for the ``cpu`` preset):

* ``name``: free text, e.g. ``"NVIDIA H100 80GB HBM3"``.
* ``peak_flops``: dense (no sparsity) peak FLOP/s per torch dtype name (``"float32"``, ``"bfloat16"``,
  ``"float16"``, ``"float8_e4m3fn"``...). Accepts a dict, stored as a sorted tuple of pairs.
  A dtype that is not listed is priced at the ``"float32"`` peak (see :meth:`DeviceSpec.peak_flops_for`).
* ``memory_bytes``: device memory in B (HBM for GPUs; RAM budget per process for CPU).
* ``memory_bandwidth``: device memory bandwidth in B/s (prices memory-bound kernels).
* ``kernel_launch_s``: fixed overhead per kernel / op launch in s.
* ``host_cores``: for CPU "devices", the cores of the host that all ranks of a node share (each
  rank computes on one thread, as ``autopar.launch`` sets it); ``0`` for accelerators, which do
  not share. The peak figures are one rank's when it has a core to itself; with more ranks than
  cores, compute is priced ``devices_per_node / host_cores`` times slower
  (:attr:`ClusterSpec.compute_slowdown`).

:class:`ClusterSpec` -- the whole cluster:

* ``name``: free text (presets use the preset name).
* ``nodes``: number of hosts (>= 1); ``devices_per_node``: devices per host (>= 1);
  ``world_size = nodes * devices_per_node``.
* ``device``: the (homogeneous) :class:`DeviceSpec`.
* ``intra_node``: link between devices of one host (NVLink/NVSwitch; loopback for ``cpu``).
* ``inter_node``: link between hosts, per device (InfiniBand / Ethernet).
* ``host_memory_bytes``: host (CPU) RAM per node in B, shared by the node's devices (offload budget).
* ``host_link``: device <-> host memory link (PCIe), per device.

Presets (``ClusterSpec.preset``): ``a100-40gb``, ``a100-80gb``, ``h100-sxm``, ``h200``, ``cpu``.

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
* [NCCL-TESTS] github.com/NVIDIA/nccl-tests (doc/PERFORMANCE.md defines "bus bandwidth"); published
  all_reduce_perf runs on 8-GPU DGX A100 reach ~230-240 GB/s busbw, on DGX H100 ~360-480 GB/s.
* [IB] InfiniBand HDR = 200 Gb/s = 25 GB/s per port, NDR = 400 Gb/s = 50 GB/s per port; DGX A100
  ships 1 HDR port per GPU, DGX H100/H200 one NDR port per GPU (DGX user guides). MPI/NCCL small-
  message latency over IB is a few microseconds.
* [DGX] DGX A100 system memory 1 TB (320 GB system) / 2 TB (640 GB system); DGX H100 and DGX H200
  system memory 2 TB (NVIDIA DGX datasheets).
* [CUDA-LAUNCH] CUDA kernel launch overhead is a few microseconds (NVIDIA CUDA best-practices guide
  and common micro-benchmarks: ~3-5 us).
* ``cpu`` preset: modest numbers for one CPU training process (one core); ``host_cores`` is the
  number of cores this process may run on (``os.sched_getaffinity``); its loopback gloo
  link is what ``autopar calibrate`` measured on a small VM (collectives cost about a millisecond);
  10 GbE = 1.25 GB/s between hosts. Run ``autopar calibrate`` for your own machine.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from autopar.errors import ClusterSpecError

__all__ = ["LinkSpec", "DeviceSpec", "ClusterSpec", "PRESET_NAMES", "DEFAULT_KERNEL_LAUNCH_S"]

GiB = 2**30
TiB = 2**40

# [CUDA-LAUNCH] typical CUDA kernel launch overhead, ~3-5 us.
DEFAULT_KERNEL_LAUNCH_S = 5e-6

_SPEC_SUFFIXES = (".json", ".yaml", ".yml")


# --------------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------------


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_float(field: str, value: Any, *, minimum: float, strict: bool) -> float:
    """A finite real number > minimum (strict) or >= minimum; returned as float."""
    rel = ">" if strict else ">="
    allowed = f"a finite number {rel} {minimum:g}"
    if not _is_number(value):
        raise ClusterSpecError(f"{field}: got {value!r} ({type(value).__name__}); must be {allowed}")
    fv = float(value)
    if not math.isfinite(fv) or (fv <= minimum if strict else fv < minimum):
        raise ClusterSpecError(f"{field}: got {value!r}; must be {allowed}")
    return fv


def _check_int(field: str, value: Any, *, minimum: int) -> int:
    """An integer >= minimum (an integral float such as 8.0 is accepted); returned as int."""
    allowed = f"an integer >= {minimum}"
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ClusterSpecError(f"{field}: got {value!r} ({type(value).__name__}); must be {allowed}")
    if value < minimum:
        raise ClusterSpecError(f"{field}: got {value!r}; must be {allowed}")
    return value


def _check_name(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ClusterSpecError(f"{field}: got {value!r}; must be a non-empty string")
    return value


_KNOWN_DTYPE_NAMES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float64")


def _dtype_name(field: str, key: Any) -> str:
    """Canonical torch dtype name ('float32', 'bfloat16', ...) for a torch.dtype or a name."""
    if isinstance(key, torch.dtype):
        return str(key).removeprefix("torch.")
    if isinstance(key, str):
        attr = getattr(torch, key.strip().removeprefix("torch."), None)
        if isinstance(attr, torch.dtype):
            return str(attr).removeprefix("torch.")
    raise ClusterSpecError(
        f"{field}: got dtype {key!r}; must be a torch.dtype or a torch dtype name such as "
        f"{', '.join(repr(n) for n in _KNOWN_DTYPE_NAMES)}"
    )


# --------------------------------------------------------------------------------------------------
# dataclasses
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkSpec:
    """A link priced as ``latency + nbytes / bandwidth`` (bandwidth in B/s, latency in s).

    ``ranges``: optional ``(collective, up_to_bytes, bandwidth, latency)`` entries, ascending in
    ``up_to_bytes`` per collective (``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``...):
    that collective on a tensor of ``B <= up_to_bytes`` bytes (the first such entry) is priced with
    the entry's figures, larger ones with its last entry's. ``autopar calibrate`` fits one per
    collective and size range, since transports change regime with message size and implement
    collectives differently (gloo's small all-reduce costs 5x its all-gather on a 2-core VM).
    A collective without entries uses ``bandwidth`` and ``latency``."""

    bandwidth: float
    latency: float
    ranges: tuple[tuple[str, float, float, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "bandwidth", _check_float("LinkSpec.bandwidth", self.bandwidth, minimum=0.0, strict=True)
        )
        object.__setattr__(
            self, "latency", _check_float("LinkSpec.latency", self.latency, minimum=0.0, strict=False)
        )
        ranges: list[tuple[str, float, float, float]] = []
        last: dict[str, float] = {}
        for i, r in enumerate(self.ranges or ()):
            if not (isinstance(r, (tuple, list)) and len(r) == 4 and isinstance(r[0], str)):
                raise ClusterSpecError(
                    f"LinkSpec.ranges[{i}]: got {r!r}; must be [collective, up_to_bytes, bandwidth B/s, latency s]"
                )
            up = _check_float(f"LinkSpec.ranges[{i}][1]", r[1], minimum=0.0, strict=True)
            bw = _check_float(f"LinkSpec.ranges[{i}][2]", r[2], minimum=0.0, strict=True)
            lat = _check_float(f"LinkSpec.ranges[{i}][3]", r[3], minimum=0.0, strict=False)
            if up <= last.get(r[0], 0.0):
                raise ClusterSpecError(
                    f"LinkSpec.ranges: up_to_bytes of {r[0]!r} must ascend, got {up} after {last[r[0]]}"
                )
            last[r[0]] = up
            ranges.append((r[0], up, bw, lat))
        object.__setattr__(self, "ranges", tuple(ranges))

    def at(self, nbytes: float, collective: str = "") -> tuple[float, float]:
        """(bandwidth, latency) for ``collective`` on a tensor of ``nbytes``."""
        mine = [r for r in self.ranges if r[0] == collective]
        for _, up, bw, lat in mine:
            if nbytes <= up:
                return bw, lat
        if mine:
            return mine[-1][2], mine[-1][3]
        return self.bandwidth, self.latency

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"bandwidth": self.bandwidth, "latency": self.latency}
        if self.ranges:
            d["ranges"] = [list(r) for r in self.ranges]
        return d


@dataclass(frozen=True)
class DeviceSpec:
    """One device: dense peak FLOP/s per dtype name, memory (B), memory bandwidth (B/s), launch cost (s)."""

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    memory_bytes: int
    memory_bandwidth: float
    kernel_launch_s: float = DEFAULT_KERNEL_LAUNCH_S
    host_cores: int = 0

    def __post_init__(self) -> None:
        _check_name("DeviceSpec.name", self.name)
        object.__setattr__(
            self, "host_cores", _check_int("DeviceSpec.host_cores", self.host_cores, minimum=0)
        )
        pf = self.peak_flops
        if isinstance(pf, Mapping):
            items = list(pf.items())
        elif isinstance(pf, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pf):
            items = [tuple(p) for p in pf]
        else:
            raise ClusterSpecError(
                f"DeviceSpec.peak_flops: got {pf!r}; must be a dict (or tuple of pairs) mapping torch dtype "
                f"names such as 'float32', 'bfloat16' to FLOP/s > 0"
            )
        if not items:
            raise ClusterSpecError(
                "DeviceSpec.peak_flops: got an empty mapping; must list at least 'float32' -> FLOP/s > 0"
            )
        norm: dict[str, float] = {}
        for key, val in items:
            name = _dtype_name("DeviceSpec.peak_flops", key)
            if name in norm:
                raise ClusterSpecError(
                    f"DeviceSpec.peak_flops: dtype {name!r} given twice (as {key!r}); list each dtype once"
                )
            norm[name] = _check_float(f"DeviceSpec.peak_flops[{name!r}]", val, minimum=0.0, strict=True)
        object.__setattr__(self, "peak_flops", tuple(sorted(norm.items())))
        object.__setattr__(
            self, "memory_bytes", _check_int("DeviceSpec.memory_bytes", self.memory_bytes, minimum=1)
        )
        object.__setattr__(
            self,
            "memory_bandwidth",
            _check_float("DeviceSpec.memory_bandwidth", self.memory_bandwidth, minimum=0.0, strict=True),
        )
        object.__setattr__(
            self,
            "kernel_launch_s",
            _check_float("DeviceSpec.kernel_launch_s", self.kernel_launch_s, minimum=0.0, strict=False),
        )

    @property
    def peak_flops_dict(self) -> dict[str, float]:
        return dict(self.peak_flops)

    def peak_flops_for(self, dtype: torch.dtype | str) -> float:
        """Dense peak FLOP/s for ``dtype``; a dtype not listed is priced at the 'float32' peak."""
        name = _dtype_name("dtype", dtype)
        table = dict(self.peak_flops)
        if name in table:
            return table[name]
        if "float32" not in table:
            raise ClusterSpecError(
                f"DeviceSpec.peak_flops: no entry for {name!r} and no 'float32' fallback on device "
                f"{self.name!r} (has {sorted(table)}); add a 'float32' entry"
            )
        return table["float32"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth": self.memory_bandwidth,
            "kernel_launch_s": self.kernel_launch_s,
            "host_cores": self.host_cores,
        }


# --------------------------------------------------------------------------------------------------
# presets (numbers with their source; see module docstring for the full references)
# --------------------------------------------------------------------------------------------------

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
# InfiniBand NDR 400 Gb/s per GPU = 50e9 B/s [IB].
_NDR_IB = LinkSpec(bandwidth=50e9, latency=_IB_LATENCY)
# PCIe Gen5 x16: 64 GB/s per direction theoretical [H100-DS], ~50 GB/s achievable.
_PCIE5 = LinkSpec(bandwidth=50e9, latency=_PCIE_LATENCY)

_DEVICES: dict[str, DeviceSpec] = {
    "a100-40gb": DeviceSpec(
        name="NVIDIA A100-SXM4-40GB",
        peak_flops=_A100_FLOPS,
        memory_bytes=40 * GiB,  # [A100-DS] 40 GB HBM2
        memory_bandwidth=1555e9,  # [A100-DS] 1,555 GB/s
        kernel_launch_s=DEFAULT_KERNEL_LAUNCH_S,  # [CUDA-LAUNCH]
    ),
    "a100-80gb": DeviceSpec(
        name="NVIDIA A100-SXM4-80GB",
        peak_flops=_A100_FLOPS,
        memory_bytes=80 * GiB,  # [A100-DS] 80 GB HBM2e
        memory_bandwidth=2039e9,  # [A100-DS] 2,039 GB/s
        kernel_launch_s=DEFAULT_KERNEL_LAUNCH_S,  # [CUDA-LAUNCH]
    ),
    "h100-sxm": DeviceSpec(
        name="NVIDIA H100 80GB HBM3",
        peak_flops=_H100_FLOPS,
        memory_bytes=80 * GiB,  # [H100-DS] 80 GB HBM3
        memory_bandwidth=3.35e12,  # [H100-DS] 3.35 TB/s
        kernel_launch_s=DEFAULT_KERNEL_LAUNCH_S,  # [CUDA-LAUNCH]
    ),
    "h200": DeviceSpec(
        name="NVIDIA H200",
        peak_flops=_H100_FLOPS,  # [H200-DS] same compute as H100 SXM
        memory_bytes=141 * GiB,  # [H200-DS] 141 GB HBM3e
        memory_bandwidth=4.8e12,  # [H200-DS] 4.8 TB/s
        kernel_launch_s=DEFAULT_KERNEL_LAUNCH_S,  # [CUDA-LAUNCH]
    ),
    "cpu": DeviceSpec(
        name="cpu",
        peak_flops={"float32": 50e9},  # conservative: one process on one core, ~50 GFLOP/s fp32
        memory_bytes=8 * GiB,  # RAM budget per process
        memory_bandwidth=20e9,  # conservative share of a DDR4/DDR5 socket's bandwidth
        kernel_launch_s=10e-6,  # eager PyTorch CPU op dispatch overhead, ~10 us
    ),
}

# (intra_node, inter_node, host_memory_bytes per node, host_link, default devices_per_node)
_NODES: dict[str, tuple[LinkSpec, LinkSpec, int, LinkSpec, int]] = {
    "a100-40gb": (_A100_NVLINK, _HDR_IB, 1 * TiB, _PCIE4, 8),  # [DGX] DGX A100 320GB: 1 TB RAM
    "a100-80gb": (_A100_NVLINK, _HDR_IB, 2 * TiB, _PCIE4, 8),  # [DGX] DGX A100 640GB: 2 TB RAM
    "h100-sxm": (_H100_NVLINK, _NDR_IB, 2 * TiB, _PCIE5, 8),  # [DGX] DGX H100: 2 TB RAM
    "h200": (_H100_NVLINK, _NDR_IB, 2 * TiB, _PCIE5, 8),  # [DGX] DGX H200: 2 TB RAM
    "cpu": (
        # gloo over loopback TCP, 4 processes on a 2-core x86 VM: `autopar calibrate --world-size 4`
        # fitted 0.47-1.07 GB/s and 0.6-1.1 ms per collective over three runs (benchmarks/README.md)
        LinkSpec(bandwidth=1e9, latency=1e-3),
        LinkSpec(bandwidth=1.25e9, latency=50e-6),  # 10 GbE = 1.25e9 B/s, TCP latency ~50 us
        32 * GiB,  # 4 processes x 8 GiB
        LinkSpec(bandwidth=20e9, latency=1e-6),  # "offload" is a memcpy in the same RAM
        4,  # CPU "devices" are processes
    ),
}

PRESET_NAMES: tuple[str, ...] = tuple(_DEVICES)

_CLUSTER_KEYS = (
    "name",
    "nodes",
    "devices_per_node",
    "device",
    "intra_node",
    "inter_node",
    "host_memory_bytes",
    "host_link",
)
_DEVICE_KEYS = ("name", "peak_flops", "memory_bytes", "memory_bandwidth", "kernel_launch_s", "host_cores")
_DEVICE_OPTIONAL = ("kernel_launch_s", "host_cores")
_LINK_KEYS = ("bandwidth", "latency", "ranges")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _coerce_number(v: Any) -> Any:
    """YAML 1.1 reads '50e9' (no dot) as a string; accept numeric strings in files."""
    if isinstance(v, str):
        try:
            return float(v.strip().replace("_", ""))
        except ValueError:
            return v
    return v


def _check_keys(where: str, d: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    if not isinstance(d, Mapping):
        raise ClusterSpecError(
            f"{where}: got {d!r} ({type(d).__name__}); must be a mapping with keys {list(required)}"
        )
    unknown = sorted(str(k) for k in d if k not in required)
    missing = [k for k in required if k not in d and k not in optional]
    if unknown or missing:
        parts = []
        if unknown:
            parts.append(f"unknown key(s) {unknown}")
        if missing:
            parts.append(f"missing key(s) {missing}")
        raise ClusterSpecError(f"{where}: {' and '.join(parts)}; allowed keys are {list(required)}")


def _link_from_dict(where: str, d: Any) -> LinkSpec:
    _check_keys(where, d, _LINK_KEYS, ("ranges",))
    ranges = d.get("ranges") or ()
    if not isinstance(ranges, (list, tuple)):
        raise ClusterSpecError(
            f"{where}.ranges: got {ranges!r}; must be a list of [up_to_bytes, bandwidth, latency]"
        )
    try:
        return LinkSpec(
            bandwidth=_coerce_number(d["bandwidth"]),
            latency=_coerce_number(d["latency"]),
            ranges=tuple(
                tuple(_coerce_number(v) for v in r) if isinstance(r, (list, tuple)) else r for r in ranges
            ),
        )
    except ClusterSpecError as e:
        raise ClusterSpecError(f"{where}: {e}") from None


def _device_from_dict(where: str, d: Any) -> DeviceSpec:
    _check_keys(where, d, _DEVICE_KEYS, _DEVICE_OPTIONAL)
    pf = d["peak_flops"]
    if isinstance(pf, Mapping):
        pf = {k: _coerce_number(v) for k, v in pf.items()}
    kw: dict[str, Any] = {
        "name": d["name"],
        "peak_flops": pf,
        "memory_bytes": _coerce_number(d["memory_bytes"]),
        "memory_bandwidth": _coerce_number(d["memory_bandwidth"]),
    }
    for key in _DEVICE_OPTIONAL:
        if key in d:
            kw[key] = _coerce_number(d[key])
    try:
        return DeviceSpec(**kw)
    except ClusterSpecError as e:
        raise ClusterSpecError(f"{where}: {e}") from None


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _gpu_preset_for(gpu_name: str, total_memory: int) -> str:
    """Closest GPU preset for a CUDA device name ("A100" + memory size, "H100", "H200"); else h100-sxm."""
    upper = gpu_name.upper()
    if "H200" in upper:
        return "h200"
    if "H100" in upper:
        return "h100-sxm"
    if "A100" in upper:
        return "a100-80gb" if total_memory > 60 * GiB else "a100-40gb"
    return "h100-sxm"  # unknown GPU: modern-GPU numbers, with the real memory size


def _gpu_device(gpu_name: str, total_memory: int) -> DeviceSpec:
    """The closest GPU preset's device, with the real device name and memory size."""
    base = _DEVICES[_gpu_preset_for(gpu_name, total_memory)]
    return dataclasses.replace(base, name=gpu_name or base.name, memory_bytes=total_memory)


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster: ``nodes`` hosts x ``devices_per_node`` devices, with its links."""

    name: str
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    host_memory_bytes: int
    host_link: LinkSpec

    def __post_init__(self) -> None:
        _check_name("ClusterSpec.name", self.name)
        object.__setattr__(self, "nodes", _check_int("ClusterSpec.nodes", self.nodes, minimum=1))
        object.__setattr__(
            self,
            "devices_per_node",
            _check_int("ClusterSpec.devices_per_node", self.devices_per_node, minimum=1),
        )
        if not isinstance(self.device, DeviceSpec):
            raise ClusterSpecError(
                f"ClusterSpec.device: got {self.device!r} ({type(self.device).__name__}); must be a DeviceSpec"
            )
        for field in ("intra_node", "inter_node", "host_link"):
            v = getattr(self, field)
            if not isinstance(v, LinkSpec):
                raise ClusterSpecError(
                    f"ClusterSpec.{field}: got {v!r} ({type(v).__name__}); must be a LinkSpec"
                )
        object.__setattr__(
            self,
            "host_memory_bytes",
            _check_int("ClusterSpec.host_memory_bytes", self.host_memory_bytes, minimum=1),
        )

    # ---------------------------------------------------------------- derived
    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def compute_slowdown(self) -> float:
        """How much slower each rank computes than the device's figures say: CPU ranks of one node
        share ``device.host_cores`` cores (1 when they do not share, or have a core each)."""
        cores = self.device.host_cores
        return max(1.0, self.devices_per_node / cores) if cores else 1.0

    def with_overrides(self, **kw: Any) -> ClusterSpec:
        """A copy with some fields replaced (validated again)."""
        unknown = sorted(set(kw) - set(_CLUSTER_KEYS))
        if unknown:
            raise ClusterSpecError(
                f"ClusterSpec.with_overrides: unknown field(s) {unknown}; allowed fields are {list(_CLUSTER_KEYS)}"
            )
        return dataclasses.replace(self, **kw)

    # ---------------------------------------------------------------- presets
    @classmethod
    def preset(cls, name: str, nodes: int = 1, devices_per_node: int | None = None) -> ClusterSpec:
        """A documented preset (see ``PRESET_NAMES``); devices_per_node defaults to 8 (GPU) or 4 (cpu)."""
        key = name.strip().lower() if isinstance(name, str) else None
        if key not in _DEVICES:
            raise ClusterSpecError(f"preset: unknown preset {name!r}; known presets are {list(PRESET_NAMES)}")
        intra, inter, host_mem, host_link, default_dpn = _NODES[key]
        device = _DEVICES[key]
        if key == "cpu":  # processes on this host: they share its cores
            device = dataclasses.replace(device, host_cores=usable_cores())
        return cls(
            name=key,
            nodes=nodes,
            devices_per_node=default_dpn if devices_per_node is None else devices_per_node,
            device=device,
            intra_node=intra,
            inter_node=inter,
            host_memory_bytes=host_mem,
            host_link=host_link,
        )

    # ---------------------------------------------------------------- (de)serialization
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict; ``from_dict`` is its inverse."""
        return {
            "name": self.name,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "device": self.device.to_dict(),
            "intra_node": self.intra_node.to_dict(),
            "inter_node": self.inter_node.to_dict(),
            "host_memory_bytes": self.host_memory_bytes,
            "host_link": self.host_link.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClusterSpec:
        """Inverse of ``to_dict``; unknown or missing keys raise ClusterSpecError naming them."""
        _check_keys("cluster", d, _CLUSTER_KEYS)
        device = _device_from_dict("cluster.device", d["device"])
        links = {f: _link_from_dict(f"cluster.{f}", d[f]) for f in ("intra_node", "inter_node", "host_link")}
        return cls(
            name=d["name"],
            nodes=_coerce_number(d["nodes"]),
            devices_per_node=_coerce_number(d["devices_per_node"]),
            device=device,
            host_memory_bytes=_coerce_number(d["host_memory_bytes"]),
            **links,
        )

    @classmethod
    def _from_data(cls, data: Any, where: str) -> ClusterSpec:
        if not isinstance(data, Mapping):
            raise ClusterSpecError(f"{where}: expected a mapping at top level, got {type(data).__name__}")
        if "preset" not in data:
            return cls.from_dict(data)
        over = dict(data)
        preset = over.pop("preset")
        if not isinstance(preset, str):
            raise ClusterSpecError(f"{where}: preset: got {preset!r}; must be one of {list(PRESET_NAMES)}")
        nodes = _coerce_number(over.pop("nodes", 1))
        dpn = over.pop("devices_per_node", None)
        base = cls.preset(preset, nodes=nodes, devices_per_node=None if dpn is None else _coerce_number(dpn))
        if not over:
            return base
        return cls.from_dict(_deep_merge(base.to_dict(), over))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write ``to_dict()`` as JSON (.json) or YAML (.yaml/.yml)."""
        p = Path(path)
        suffix = p.suffix.lower()
        if suffix == ".json":
            p.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        elif suffix in (".yaml", ".yml"):
            p.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        else:
            raise ClusterSpecError(
                f"path: got {str(path)!r}; the extension must be one of {list(_SPEC_SUFFIXES)}"
            )

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ClusterSpec:
        """Load a spec file (.json/.yaml/.yml): a full ``to_dict()`` or ``{"preset": ..., overrides}``."""
        p = Path(path)
        suffix = p.suffix.lower()
        if suffix not in _SPEC_SUFFIXES:
            raise ClusterSpecError(
                f"path: got {str(path)!r}; the extension must be one of {list(_SPEC_SUFFIXES)}"
            )
        try:
            text = p.read_text()
        except OSError as e:
            raise ClusterSpecError(f"path: cannot read cluster spec file {str(path)!r}: {e}") from None
        try:
            data = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise ClusterSpecError(f"path: {str(path)!r} is not valid {suffix[1:].upper()}: {e}") from None
        try:
            return cls._from_data(data, str(path))
        except ClusterSpecError as e:
            raise ClusterSpecError(f"in {str(path)!r}: {e}") from None

    _PARSE_RE = re.compile(r"^(?P<preset>[^:]+):(?P<nodes>\d+)x(?P<dpn>\d+)$")

    @classmethod
    def parse(cls, text: str) -> ClusterSpec:
        """CLI form: ``PRESET``, ``PRESET:NODESxDEVICES`` (e.g. ``h100-sxm:8x8``) or a spec file path."""
        usage = (
            f"expected PRESET, PRESET:NODESxDEVICES (e.g. 'h100-sxm:8x8') or a path to a "
            f"{'/'.join(_SPEC_SUFFIXES)} file; presets are {list(PRESET_NAMES)}"
        )
        if not isinstance(text, str) or not text.strip():
            raise ClusterSpecError(f"cluster: got {text!r}; {usage}")
        s = text.strip()
        if s.lower().endswith(_SPEC_SUFFIXES) or os.path.isfile(s):
            return cls.from_file(s)
        if ":" in s:
            m = cls._PARSE_RE.match(s)
            if m is None:
                raise ClusterSpecError(f"cluster: malformed cluster string {text!r}; {usage}")
            if m["preset"].strip().lower() not in _DEVICES:
                raise ClusterSpecError(f"cluster: unknown preset {m['preset']!r} in {text!r}; {usage}")
            return cls.preset(m["preset"], nodes=int(m["nodes"]), devices_per_node=int(m["dpn"]))
        if s.lower() not in _DEVICES:
            raise ClusterSpecError(f"cluster: unknown preset or missing file {text!r}; {usage}")
        return cls.preset(s)

    # ---------------------------------------------------------------- live process group
    @classmethod
    def local(cls, name: str = "local") -> ClusterSpec:
        """Describe the live torch.distributed process group (world size, node layout, device kind)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ClusterSpecError(
                "torch.distributed: the default process group is not initialized; call "
                "torch.distributed.init_process_group(...) first or launch with torchrun"
            )
        world = dist.get_world_size()
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is not None and env.strip():
            try:
                dpn = int(env)
            except ValueError:
                raise ClusterSpecError(
                    f"LOCAL_WORLD_SIZE: got {env!r}; must be a positive integer dividing the world size {world}"
                ) from None
        else:
            dpn = world
        if dpn < 1 or world % dpn != 0:
            raise ClusterSpecError(
                f"LOCAL_WORLD_SIZE: got {dpn}; must be a positive integer dividing the world size {world}"
            )
        backend = str(dist.get_backend()).lower()
        if backend == "gloo" or not torch.cuda.is_available():
            preset = "cpu"
            device = dataclasses.replace(_DEVICES["cpu"], host_cores=usable_cores())
        else:
            props = torch.cuda.get_device_properties(0)
            gpu_name = torch.cuda.get_device_name(0)
            preset = _gpu_preset_for(gpu_name, int(props.total_memory))
            device = _gpu_device(gpu_name, int(props.total_memory))
        intra, inter, host_mem, host_link, _ = _NODES[preset]
        return cls(
            name=name,
            nodes=world // dpn,
            devices_per_node=dpn,
            device=device,
            intra_node=intra,
            inter_node=inter,
            host_memory_bytes=host_mem,
            host_link=host_link,
        )
