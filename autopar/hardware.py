"""Hardware building blocks of a cluster description: links and devices, validated.

Units everywhere: seconds (s), bytes (B), FLOP/s, bytes/s (B/s). All classes are frozen (hashable)
dataclasses validated on construction; an invalid value raises
:class:`autopar.errors.ClusterSpecError` naming the field, the bad value and what is allowed.

Fields
------
:class:`LinkSpec` -- one kind of point-to-point/collective link, priced as ``latency + bytes / bandwidth``:

* ``bandwidth``: achievable bandwidth in B/s (> 0). For GPU interconnects this is the *bus bandwidth*
  an NCCL all-reduce reaches (as reported by nccl-tests), not the marketing total.
* ``latency``: fixed per-message cost in s (>= 0).
* ``ranges``: collective- and size-specific ``(bandwidth, latency)`` pairs fitted by ``autopar
  calibrate`` (:class:`LinkSpec`); no preset carries any. Besides one entry per collective, a
  calibration of CPU (gloo) ranks writes two kinds that only ranks sharing a host's cores need:
  per group layout of a mesh axis (``"all_reduce/2x1"``, ``cost_model.comm.group_ranges``) and
  the all-reduce queued behind another (``"all_reduce_queued"``, ``comm.QUEUED_ALL_REDUCE``).

:class:`DeviceSpec` -- one accelerator (or one CPU process for the ``cpu`` preset):

* ``name``: free text, e.g. ``"NVIDIA H100 80GB HBM3"``; nothing is decided from it.
* ``kind``: a :class:`DeviceKind` (``CPU``, ``CUDA``), given explicitly (keyword-only, no
  default): what the code that prices, fuses and profiles for the device reads, never the name.
* ``peak_flops``: dense (no sparsity) peak FLOP/s per torch dtype name (``"float32"``, ``"bfloat16"``,
  ``"float16"``, ``"float8_e4m3fn"``...). Accepts a dict, stored as a sorted tuple of pairs.
  A dtype that is not listed is priced at the ``"float32"`` peak (see :meth:`DeviceSpec.peak_flops_for`).
  The ``"float8_e4m3fn"`` entry is the device's FP8 GEMM rate (``DeviceSpec.float8_flops``): a
  device without it has no FP8, and the search never runs a linear FP8 there unless told to.
* ``memory_bytes``: device memory in B (HBM for GPUs; RAM budget per process for CPU).
* ``memory_bandwidth``: device memory bandwidth in B/s (prices memory-bound kernels), as a step
  sees it: each op writing a fresh tensor (``autopar/tools/calibrate_compute.py``).
* ``inplace_bandwidth``: in B/s, what an elementwise op that updates a tensor in place streams
  (an optimizer's ``add_``, ``mul_``, ``addcdiv_``: nothing freshly allocated to write into, so on
  CPUs it runs faster than ``memory_bandwidth``; fitted by ``autopar calibrate``). 0 (the GPU
  presets): ``memory_bandwidth``.
* ``kernel_launch_s``: fixed overhead per kernel / op launch in s.
* ``matmul_dim_half``: in elements, the smallest GEMM size ``d`` (of ``m``, ``k``, ``n``) at which
  a matmul reaches half its large-GEMM efficiency: a GEMM runs ``d / (d + matmul_dim_half)`` as
  fast (``cost_model/compute.py``). ``autopar calibrate`` fits it; the ``h100-sxm`` and ``h200``
  presets take it from measured ops (``autopar/presets.py``); 0 (the A100 presets): no loss.
* ``matmul_overhead_s``: fixed seconds per GEMM (a forward matmul, or each of its backward's)
  beyond ``kernel_launch_s``: what a small GEMM costs whatever its FLOPs (packing its operands,
  the autograd of a matmul). ``autopar calibrate`` fits it (so do the H100 / H200 presets, from
  measured ops); 0: none.
* ``comm_overlap``: in [0, 1], the fraction of the ideal overlap of a gradient all-reduce with
  concurrent backward compute that the device realizes (``cost_model/overlap.py``); 0 prices
  overlapped collectives as if they ran inline. ``autopar calibrate`` measures it.
* ``step_overhead_s``: fixed host seconds per training step outside the graph's ops: the autograd
  engine starting ``backward()``, ``optimizer.step()`` and ``zero_grad()`` as Python calls.
  ``autopar calibrate`` measures it; 0 where not measured (the GPU presets).
* ``optimizer_param_s``: per optimizer (``"SGD"``, ``"SGD_MOMENTUM"``, ``"ADAM"``, the names of
  ``passes.costs.Optimizer``), the fixed seconds its ``step()`` spends per parameter tensor
  beyond the bytes it moves: PyTorch's default per-tensor implementation on CPU launches a
  few ops per tensor (Adam ~8, SGD one; ``autopar calibrate`` times them). Where an optimizer
  is not listed, one ``kernel_launch_s`` per tensor.
* ``contention``: a :class:`HostContention` where the "devices" are processes that share one
  host's cores (the ``cpu`` preset, ``ClusterSpec.local()`` on gloo, ``autopar calibrate`` on
  gloo); ``None`` for accelerators (every GPU preset), which share nothing and pay none of its
  terms.

:class:`HostContention` -- what ranks that share a host's cores cost beyond one rank's figures:

* ``host_cores``: the cores of the host that all ranks of a node share (each rank computes on one
  thread, as ``autopar.launch`` sets it; ``usable_cores()``). The device's peak figures are one
  rank's when it has a core to itself; with more ranks than cores, compute is priced
  ``devices_per_node / host_cores`` times slower (:attr:`ClusterSpec.compute_slowdown`;
  processor sharing). 0: not counted, no slowdown.
* ``sync_wait``: in s^0.5, how fast ranks drift apart between two synchronizing collectives: the
  expected wait for the slowest rank after ``d`` seconds of compute is ``sync_wait * sqrt(d)``
  (a random walk; ``cost_model/sync.py``). Fitted by ``autopar calibrate`` (``measure_sync_wait``).
  ``sync_wait_kinds``: the same per kind of collective (``"all_reduce"``, ``"all_gather"``,
  ``"reduce_scatter"``), where measured; ``sync_wait`` prices the kinds not listed. Where ranks
  share cores, a collective's wait grows with its sequential steps (a ring all-reduce has twice an
  all-gather's), so the kinds differ.

Figures these fields took on the development machine: ``benchmarks/README.md`` ("Readings of the
development VM"). Where preset figures come from: ``autopar/presets.py``.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from autopar.errors import ClusterSpecError, UnsupportedDeviceKindError

__all__ = [
    "LinkSpec",
    "DeviceKind",
    "DeviceSpec",
    "HostContention",
    "DEFAULT_KERNEL_LAUNCH_S",
    "per_kind",
    "usable_cores",
]

GiB = 2**30
TiB = 2**40

# [CUDA-LAUNCH] typical CUDA kernel launch overhead, ~3-5 us.
DEFAULT_KERNEL_LAUNCH_S = 5e-6


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
    close = difflib.get_close_matches(str(key), _KNOWN_DTYPE_NAMES, n=1, cutoff=0.6)
    raise ClusterSpecError(
        f"{field}: got dtype {key!r}{f' (did you mean {close[0]!r}?)' if close else ''}; must be a "
        f"torch.dtype or a torch dtype name such as {', '.join(repr(n) for n in _KNOWN_DTYPE_NAMES)}"
    )


# --------------------------------------------------------------------------------------------------
# device kinds
# --------------------------------------------------------------------------------------------------


class DeviceKind(enum.Enum):
    """What a device is, for the code that plans for it: each value is the torch device type its
    ranks run on (``torch.device(kind.value)``, ``torch.autocast(kind.value)``).

    Code that needs to know something per kind reads it from a table keyed by kind through
    :func:`per_kind`, which raises :class:`autopar.errors.UnsupportedDeviceKindError` naming the
    table for a kind it lacks (never another kind's entry). Adding a kind (an XPU, say) is a member
    here, valued as its torch device type, and its entry in each place that knows kinds:

    * ``passes/precision.py`` ``AUTOCAST_BY_KIND``: the ops its autocast runs in the half type and
      in fp32 (pricing mixed precision);
    * ``passes/fuse.py`` ``AUTO_KERNELS``: the fused kernels a search uses there by default;
    * ``cost_model/comm.py`` ``NATIVE_REDUCE_SCATTER``: whether its transport has a reduce-scatter
      (else it runs, and is priced as, an all-reduce);
    * ``autopar/tools/profiler.py`` ``profile_device_for``: the local device that measures for it
      (ProfilerDeviceError without one);
    * where the kind of the machine the code runs on is learnt from the process group's backend
      (``ClusterSpec.local()``, ``autopar calibrate``, ``codegen/build.py``'s run device);
    * a preset in ``autopar/presets.py``, where it has one."""

    CPU = "cpu"
    CUDA = "cuda"

    @classmethod
    def parse(cls, value: Any, field: str = "DeviceSpec.kind") -> DeviceKind:
        """A ``DeviceKind``, or the kind whose value is the string ``value`` (any case);
        ClusterSpecError naming ``field`` otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for kind in cls:
                if kind.value == value.strip().lower():
                    return kind
        raise ClusterSpecError(
            f"{field}: got {value!r}; must be a DeviceKind or one of {[k.value for k in cls]} "
            f"(a new kind is added as DeviceKind's docstring says)"
        )


def per_kind(table: Mapping[DeviceKind, Any], kind: DeviceKind, what: str, where: str) -> Any:
    """``table[kind]``: the entry of a per-kind table (``what`` it holds, defined ``where``);
    UnsupportedDeviceKindError naming the table where ``kind`` has none."""
    if kind not in table:
        known = ", ".join(k.name for k in table)
        raise UnsupportedDeviceKindError(
            f"no {what} for device kind {kind.name} (known for: {known}); add an entry for "
            f"DeviceKind.{kind.name} to {where}, or plan for a cluster whose DeviceSpec.kind is one of these"
        )
    return table[kind]


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
    collectives differently (gloo's small all-reduce costs several times its all-gather). Only a
    calibrated link has ranges (no preset does); a calibration of CPU ranks also writes the
    per-group-layout and queued all-reduce entries of ``cost_model/comm.py`` (``group_ranges``,
    ``QUEUED_ALL_REDUCE``). A collective without entries uses ``bandwidth`` and ``latency``."""

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


def _op_table(field: str, unit: str, value: Any) -> tuple[tuple[str, float, float], ...]:
    """``{op: [forward, backward]}`` (or its tuple form) as sorted ``(op, forward, backward)``."""
    items = list(value.items()) if isinstance(value, Mapping) else [(p[0], *p[1:]) for p in value]
    table = []
    for item in items:
        if len(item) == 2 and isinstance(item[1], (list, tuple)):
            item = (item[0], *item[1])
        if len(item) != 3 or not isinstance(item[0], str):
            raise ClusterSpecError(
                f"DeviceSpec.{field}: got entry {item!r}; must map an op name such as "
                f"'aten.tanh.default' to [forward, backward] seconds per {unit}"
            )
        f = _check_float(f"DeviceSpec.{field}[{item[0]!r}][0]", item[1], minimum=0.0, strict=False)
        b = _check_float(f"DeviceSpec.{field}[{item[0]!r}][1]", item[2], minimum=0.0, strict=False)
        table.append((item[0], f, b))
    return tuple(sorted(table))


def _name_table(field: str, value: Any, key: str, what: str) -> tuple[tuple[str, float], ...]:
    """``{name: number >= 0}`` (or its tuple form) as sorted ``(name, number)`` pairs; ``field``
    names it in errors (``"DeviceSpec.optimizer_param_s"``)."""
    items = list(value.items()) if isinstance(value, Mapping) else [tuple(p) for p in value]
    if not all(len(p) == 2 and isinstance(p[0], str) for p in items):
        raise ClusterSpecError(f"{field}: got {value!r}; must map {key} to {what}")
    return tuple(sorted((k, _check_float(f"{field}[{k!r}]", v, minimum=0.0, strict=False)) for k, v in items))


def _lookup(table: tuple[tuple[str, float, float], ...], op: str) -> tuple[float, float] | None:
    for name, f, b in table:
        if name == op:
            return f, b
    return None


@dataclass(frozen=True)
class HostContention:
    """Processes that share one host's cores as ranks (the ``cpu`` device kind, gloo): what they
    cost beyond one rank's device figures (module docstring). Carried by ``DeviceSpec.contention``
    of CPU devices only; every field's neutral value prices nothing.

    * compute: ``slowdown(ranks) = max(1, ranks / host_cores)`` (1 where ``host_cores`` is 0);
    * the wait for the slowest rank at a synchronizing collective of ``kind`` after ``d`` seconds
      of compute: ``sync_wait_for(kind) * sqrt(d)`` [s] (``cost_model/sync.py``)."""

    host_cores: int = 0
    sync_wait: float = 0.0
    sync_wait_kinds: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "host_cores", _check_int("HostContention.host_cores", self.host_cores, minimum=0)
        )
        object.__setattr__(
            self,
            "sync_wait",
            _check_float("HostContention.sync_wait", self.sync_wait, minimum=0.0, strict=False),
        )
        object.__setattr__(
            self,
            "sync_wait_kinds",
            _name_table("HostContention.sync_wait_kinds", self.sync_wait_kinds,
                        "a collective such as 'all_reduce'", "its sync_wait in s^0.5"),
        )  # fmt: skip

    def slowdown(self, ranks: int) -> float:
        """How much slower each of ``ranks`` ranks of one host computes than one rank alone."""
        return max(1.0, ranks / self.host_cores) if self.host_cores else 1.0

    def sync_wait_for(self, kind: str) -> float:
        """``sync_wait`` [s^0.5] of a synchronizing ``kind`` of collective: its own figure where
        measured, else ``sync_wait``."""
        return dict(self.sync_wait_kinds).get(kind, self.sync_wait)

    @property
    def neutral(self) -> bool:
        """True when it prices nothing (no cores counted, no wait)."""
        return not self.host_cores and not self.sync_wait and not any(v for _, v in self.sync_wait_kinds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "host_cores": self.host_cores,
            "sync_wait": self.sync_wait,
            "sync_wait_kinds": dict(self.sync_wait_kinds),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HostContention:
        """Inverse of ``to_dict``; missing keys take their neutral value, unknown ones raise."""
        unknown = sorted(str(k) for k in d if k not in _CONTENTION_KEYS)
        if unknown:
            raise ClusterSpecError(
                f"HostContention: unknown key(s) {unknown}; allowed keys are {list(_CONTENTION_KEYS)}"
            )
        return cls(**{k: d[k] for k in _CONTENTION_KEYS if k in d})


_CONTENTION_KEYS = tuple(f.name for f in dataclasses.fields(HostContention))


@dataclass(frozen=True)
class DeviceSpec:
    """One device of a ``kind``: dense peak FLOP/s per dtype name, memory (B), memory bandwidth
    (B/s), launch cost (s). ``kind`` is keyword-only and required; a string naming a kind's value
    (``"cuda"``) is accepted and stored as the :class:`DeviceKind`.

    Optional, measured by ``autopar calibrate`` (see ``cost_model/compute.py`` for how they price),
    per op name (``str`` of the aten overload), the seconds of its forward and of its backward:
    ``pointwise_s`` per element of its largest tensor, for ops whose arithmetic (tanh, exp, erf,
    softmax, cross-entropy ...) rather than their bytes decides their time on this device;
    ``per_flop_s`` per forward FLOP, for ops whose kernels run far from the matmul rate
    (attention on a CPU)."""

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    memory_bytes: int
    memory_bandwidth: float
    kernel_launch_s: float = DEFAULT_KERNEL_LAUNCH_S
    comm_overlap: float = 0.0
    pointwise_s: tuple[tuple[str, float, float], ...] = ()
    per_flop_s: tuple[tuple[str, float, float], ...] = ()
    step_overhead_s: float = 0.0
    optimizer_param_s: tuple[tuple[str, float], ...] = ()
    inplace_bandwidth: float = 0.0
    matmul_dim_half: float = 0.0
    matmul_overhead_s: float = 0.0
    contention: HostContention | None = None
    kind: DeviceKind = dataclasses.field(kw_only=True)

    def __post_init__(self) -> None:
        _check_name("DeviceSpec.name", self.name)
        object.__setattr__(self, "kind", DeviceKind.parse(self.kind))
        for name in (
            "kernel_launch_s",
            "step_overhead_s",
            "inplace_bandwidth",
            "matmul_dim_half",
            "matmul_overhead_s",
        ):
            value = _check_float(f"DeviceSpec.{name}", getattr(self, name), minimum=0.0, strict=False)
            object.__setattr__(self, name, value)
        object.__setattr__(
            self,
            "optimizer_param_s",
            _name_table("DeviceSpec.optimizer_param_s", self.optimizer_param_s,
                        "an optimizer name such as 'ADAM'", "seconds per parameter tensor"),
        )  # fmt: skip
        object.__setattr__(self, "pointwise_s", _op_table("pointwise_s", "element", self.pointwise_s))
        object.__setattr__(self, "per_flop_s", _op_table("per_flop_s", "FLOP", self.per_flop_s))
        overlap = _check_float("DeviceSpec.comm_overlap", self.comm_overlap, minimum=0.0, strict=False)
        if overlap > 1.0:
            raise ClusterSpecError(f"DeviceSpec.comm_overlap: got {overlap!r}; must be in [0, 1]")
        object.__setattr__(self, "comm_overlap", overlap)
        if isinstance(self.contention, Mapping):
            object.__setattr__(self, "contention", HostContention.from_dict(self.contention))
        if self.contention is not None and not isinstance(self.contention, HostContention):
            raise ClusterSpecError(
                f"DeviceSpec.contention: got {self.contention!r} ({type(self.contention).__name__}); "
                f"must be a HostContention (ranks sharing a host's cores: the cpu device kind) or None"
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

    def pointwise(self, op: str) -> tuple[float, float] | None:
        """(forward, backward) seconds per element measured for ``op``, or None."""
        return _lookup(self.pointwise_s, op)

    def per_flop(self, op: str) -> tuple[float, float] | None:
        """(forward, backward) seconds per forward FLOP measured for ``op``, or None."""
        return _lookup(self.per_flop_s, op)

    @property
    def inplace_bw(self) -> float:
        """B/s of an in-place elementwise update (``inplace_bandwidth``, else ``memory_bandwidth``)."""
        return self.inplace_bandwidth or self.memory_bandwidth

    def sync_wait_for(self, kind: str) -> float:
        """``sync_wait`` [s^0.5] of a synchronizing ``kind`` of collective (``"all_reduce"``,
        ``"all_gather"``, ...) from ``contention`` (:meth:`HostContention.sync_wait_for`); 0
        without a contention model (the GPU presets)."""
        return self.contention.sync_wait_for(kind) if self.contention is not None else 0.0

    def with_contention(self, **fields: Any) -> DeviceSpec:
        """A copy whose ``contention`` has ``fields`` replaced (a neutral :class:`HostContention`
        where there is none yet), e.g. ``device.with_contention(host_cores=2)``."""
        base = self.contention if self.contention is not None else HostContention()
        return dataclasses.replace(self, contention=dataclasses.replace(base, **fields))

    def optimizer_param(self, optimizer: str) -> float:
        """Fixed seconds ``optimizer``'s step spends per parameter tensor (one launch if not measured)."""
        return dict(self.optimizer_param_s).get(optimizer, self.kernel_launch_s)

    @property
    def float8_flops(self) -> float | None:
        """Dense FP8 (``float8_e4m3fn``) GEMM FLOP/s, the ``peak_flops`` entry of that dtype; None
        where the device lists none (no FP8 tensor cores: A100, CPUs), and then no search chooses
        FP8 linears for it (``autopar/lowerings/float8.py``)."""
        return dict(self.peak_flops).get("float8_e4m3fn")

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
            "kind": self.kind.value,
            "peak_flops": dict(self.peak_flops),
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth": self.memory_bandwidth,
            "kernel_launch_s": self.kernel_launch_s,
            "comm_overlap": self.comm_overlap,
            "pointwise_s": {name: [f, b] for name, f, b in self.pointwise_s},
            "per_flop_s": {name: [f, b] for name, f, b in self.per_flop_s},
            "step_overhead_s": self.step_overhead_s,
            "optimizer_param_s": dict(self.optimizer_param_s),
            "inplace_bandwidth": self.inplace_bandwidth,
            "matmul_dim_half": self.matmul_dim_half,
            "matmul_overhead_s": self.matmul_overhead_s,
        } | ({"contention": self.contention.to_dict()} if self.contention is not None else {})


# set by ``autopar.launch.pin_to_core``: how many cores the ranks of this host share, for a rank
# whose own affinity is now the one core it is bound to
HOST_CORES_ENV = "AUTOPAR_HOST_CORES"


def usable_cores() -> int:
    """Cores the ranks of this host may run on: the launcher's CPU affinity where
    ``autopar.launch.pin_to_core`` bound this rank to one of them, else this process's affinity,
    else the machine's count."""
    if os.environ.get(HOST_CORES_ENV, "").isdigit() and int(os.environ[HOST_CORES_ENV]) > 0:
        return int(os.environ[HOST_CORES_ENV])
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
