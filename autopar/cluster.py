"""Description of a training cluster, as data for the analytical cost model.

Units everywhere: seconds (s), bytes (B), FLOP/s, bytes/s (B/s). All classes are frozen (hashable)
dataclasses validated on construction; an invalid value raises
:class:`autopar.errors.ClusterSpecError` naming the field, the bad value and what is allowed.

Links, devices and the contention of CPU ranks sharing a host (:class:`LinkSpec`,
:class:`DeviceSpec`, :class:`HostContention`, their fields and units): ``autopar/hardware.py``;
presets and the sources of their numbers: ``autopar/presets.py``.

:class:`ClusterSpec` -- the whole cluster:

* ``name``: free text (presets use the preset name).
* ``nodes``: number of hosts (>= 1); ``devices_per_node``: devices per host (>= 1);
  ``world_size = nodes * devices_per_node``.
* ``device``: the (homogeneous) :class:`DeviceSpec`; its ``kind`` (:class:`DeviceKind`) is what
  the planning reads to know what the devices are. Spec files written before devices had a kind
  load with one inferred from the device's name (:func:`_legacy_kind`, the only place that does).
* ``intra_node``: link between devices of one host (NVLink/NVSwitch; loopback for ``cpu``).
* ``inter_node``: link between hosts, per device (InfiniBand / Ethernet).
* ``host_memory_bytes``: host (CPU) RAM per node in B, shared by the node's devices (offload budget).
* ``host_link``: device <-> host memory link (PCIe), per device.
* ``host_memory_bandwidth``: the host's own memory bandwidth per node in B/s, shared by the
  node's devices (an offloaded optimizer steps there); None: unknown, priced at ``host_link``'s.
* ``memory_reserve``: fraction of each device's memory a plan leaves unused (default
  ``DEFAULT_MEMORY_RESERVE`` = 0.1), of ``device.memory_bytes`` or of an explicit
  ``memory_limit_bytes`` alike: the plan's predicted peak stays under ``(1 - memory_reserve)`` of it.
  It holds what the cost model does not count: the caching allocator's fragmentation and block
  rounding, the CUDA context and library workspaces (cuBLAS, NCCL buffers), and the model's own
  error (within +-10% of the measured live tensor bytes in ``benchmarks/bench_cost_accuracy.py``).
  Optional in spec files.

Presets (``ClusterSpec.preset``): ``a100-40gb``, ``a100-80gb``, ``h100-sxm``, ``h100-96gb``, ``h200``,
``b200``, ``cpu``.

Spec files (``ClusterSpec.from_file``, JSON or YAML) hold either a whole ``to_dict()`` or a preset
and what differs from it::

    {"base": "h100-sxm", "nodes": 2, "device": {"memory_bytes": 40e9},
     "inter_node": {"bandwidth": 25e9}}

``base`` names the preset (``preset`` is read too); ``nodes`` and ``devices_per_node`` size it as
``ClusterSpec.preset`` does; every other key is a field of ``to_dict()``, a nested mapping merged
key by key into the preset's (``device.peak_flops``, ``device.contention``, a link), so the file
equals the preset with those fields replaced. An unknown key, at any level, is named with the
nearest known one.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from autopar.errors import ClusterSpecError
from autopar.hardware import (
    _CONTENTION_KEYS,
    DEFAULT_KERNEL_LAUNCH_S,
    DeviceKind,
    DeviceSpec,
    HostContention,
    LinkSpec,
    _check_int,
    _check_name,
    usable_cores,
)
from autopar.presets import _DEVICES, _NODES, PRESET_NAMES, _cpu_device, _gpu_device, _gpu_preset_for

__all__ = [
    "LinkSpec",
    "DeviceKind",
    "DeviceSpec",
    "HostContention",
    "ClusterSpec",
    "PRESET_NAMES",
    "DEFAULT_KERNEL_LAUNCH_S",
    "usable_cores",
]

_SPEC_SUFFIXES = (".json", ".yaml", ".yml")


_CLUSTER_KEYS = (
    "name",
    "nodes",
    "devices_per_node",
    "device",
    "intra_node",
    "inter_node",
    "host_memory_bytes",
    "host_link",
    "memory_reserve",
    "host_memory_bandwidth",
)
_CLUSTER_OPTIONAL = ("memory_reserve", "host_memory_bandwidth")
# fraction of device memory a plan leaves free by default (see the module docstring for what it holds)
DEFAULT_MEMORY_RESERVE = 0.1
_DEVICE_OPTIONAL = (
    "kind",  # required in code; files written before it existed lack it (_legacy_kind)
    "kernel_launch_s",
    "comm_overlap",
    "pointwise_s",
    "per_flop_s",
    "step_overhead_s",
    "optimizer_param_s",
    "inplace_bandwidth",
    "matmul_dim_half",
    "matmul_overhead_s",
    "contention",
)
# ``HostContention``'s fields as flat device keys: how spec files written before ``contention``
# existed give them; still read (into ``contention``), never written
_LEGACY_CONTENTION_KEYS = _CONTENTION_KEYS
_DEVICE_KEYS = ("name", "peak_flops", "memory_bytes", "memory_bandwidth", *_DEVICE_OPTIONAL)
_LINK_KEYS = ("bandwidth", "latency", "ranges")


def _coerce_number(v: Any) -> Any:
    """YAML 1.1 reads '50e9' (no dot) as a string; accept numeric strings in files."""
    if isinstance(v, str):
        try:
            return float(v.strip().replace("_", ""))
        except ValueError:
            return v
    return v


def did_you_mean(word: Any, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` where ``word`` is close to one of ``choices`` (difflib), else ``""``."""
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_keys(
    where: str,
    d: Any,
    keys: tuple[str, ...],
    optional: tuple[str, ...] = (),
    unlisted: tuple[str, ...] = (),
) -> None:
    """``d`` is a mapping of ``keys`` (all but ``optional`` required) and of ``unlisted`` ones
    (read, never written, so not offered in the message); an unknown key is named with the
    nearest known one, a missing one with what is required and what is optional."""
    required = [k for k in keys if k not in optional]
    if not required:
        listed = f"allowed keys {list(keys)}"
    else:
        listed = f"required keys {required}" + (
            f", optional {[k for k in keys if k in optional]}" if optional else ""
        )
    if not isinstance(d, Mapping):
        raise ClusterSpecError(f"{where}: got {d!r} ({type(d).__name__}); must be a mapping with {listed}")
    unknown = sorted(str(k) for k in d if k not in keys and k not in unlisted)
    missing = [k for k in required if k not in d]
    if unknown or missing:
        parts = [f"unknown key {k!r}{did_you_mean(k, keys)}" for k in unknown]
        if missing:
            parts.append(f"missing key(s) {missing}")
        raise ClusterSpecError(f"{where}: {'; '.join(parts)}; {listed}")


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


def _coerce_table(t: Any) -> Any:
    """``{op: [forward, backward]}`` with numbers written as text (YAML) made numbers."""
    if not isinstance(t, Mapping):
        return t
    return {k: [_coerce_number(x) for x in v] if isinstance(v, (list, tuple)) else v for k, v in t.items()}


def _contention_from_dict(where: str, d: Mapping[str, Any]) -> HostContention | None:
    """``device["contention"]``, with the flat keys of older spec files
    (``_LEGACY_CONTENTION_KEYS``) merged in over it; None where it is missing, or given only by
    flat keys that price nothing (``host_cores: 0, sync_wait: 0``, as older files give every GPU)."""
    c = d.get("contention")
    if c is None and not any(k in d for k in _LEGACY_CONTENTION_KEYS):
        return None
    if c is not None and not isinstance(c, Mapping):
        raise ClusterSpecError(
            f"{where}.contention: got {c!r}; must be a mapping with keys {list(_CONTENTION_KEYS)} or null"
        )
    merged = {**(c or {}), **{k: d[k] for k in _LEGACY_CONTENTION_KEYS if k in d}}
    _check_keys(f"{where}.contention", merged, _CONTENTION_KEYS, _CONTENTION_KEYS)
    kw = {
        k: {n: _coerce_number(v) for n, v in x.items()} if isinstance(x, Mapping) else _coerce_number(x)
        for k, x in merged.items()
    }
    try:
        contention = HostContention(**kw)
    except ClusterSpecError as e:
        raise ClusterSpecError(f"{where}.contention: {e}") from None
    return None if c is None and contention.neutral else contention


def _legacy_kind(name: Any) -> DeviceKind:
    """The kind of a device read from a spec file written before ``DeviceSpec.kind`` existed (no
    ``"kind"`` key), for such old files only: every file the code writes now names its kind.
    ``CPU`` where the name starts with "cpu" (the ``cpu`` preset's, which ``ClusterSpec.local()``
    on gloo and ``autopar calibrate`` on CPU ranks kept), else ``CUDA`` (the GPU presets'
    names, and the real GPU's name from ``ClusterSpec.local()``): the rule the planning applied
    to device names before devices had a kind, so an old file plans as it did."""
    cpu = isinstance(name, str) and name.strip().lower().startswith("cpu")
    return DeviceKind.CPU if cpu else DeviceKind.CUDA


def _device_from_dict(where: str, d: Any) -> DeviceSpec:
    _check_keys(where, d, _DEVICE_KEYS, _DEVICE_OPTIONAL, _LEGACY_CONTENTION_KEYS)
    pf = d["peak_flops"]
    if isinstance(pf, Mapping):
        pf = {k: _coerce_number(v) for k, v in pf.items()}
    kw: dict[str, Any] = {
        "name": d["name"],
        "kind": d["kind"] if "kind" in d else _legacy_kind(d["name"]),
        "peak_flops": pf,
        "memory_bytes": _coerce_number(d["memory_bytes"]),
        "memory_bandwidth": _coerce_number(d["memory_bandwidth"]),
    }
    for key in _DEVICE_OPTIONAL:
        if key == "kind":
            continue
        if key == "contention":
            kw[key] = _contention_from_dict(where, d)
        elif key in d:
            if key in ("pointwise_s", "per_flop_s"):
                kw[key] = _coerce_table(d[key])
            elif key == "optimizer_param_s" and isinstance(d[key], Mapping):
                kw[key] = {k: _coerce_number(v) for k, v in d[key].items()}
            else:
                kw[key] = _coerce_number(d[key])
    try:
        return DeviceSpec(**kw)
    except ClusterSpecError as e:
        raise ClusterSpecError(f"{where}: {e}") from None


def _host_bandwidth(device: DeviceSpec, node_bandwidth: float | None) -> float | None:
    """A preset node's ``host_memory_bandwidth``: a CPU device's host is the device itself (its
    ``memory_bandwidth``), an accelerator's the node's figure."""
    return device.memory_bandwidth if device.kind is DeviceKind.CPU else node_bandwidth


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


# the key of a spec file that starts from a preset (``"base": "h100-sxm"``); ``preset`` is read too
BASE_KEYS = ("base", "preset")


def _check_base_hint(data: Mapping[str, Any]) -> None:
    """A file with neither a whole cluster nor a ``base``: its unknown keys named (with the nearest
    known one), then what is missing, with the shorter form that starts from a preset."""
    try:
        _check_keys("cluster", data, _CLUSTER_KEYS, _CLUSTER_OPTIONAL)
    except ClusterSpecError as e:
        raise ClusterSpecError(
            f"{e}; or start from a preset and give only what differs, e.g. "
            '{"base": "h100-sxm", "nodes": 2, "device": {"memory_bytes": 40e9}} '
            f"(presets are {list(PRESET_NAMES)})"
        ) from None


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
    memory_reserve: float = DEFAULT_MEMORY_RESERVE
    host_memory_bandwidth: float | None = None

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
        r = self.memory_reserve
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
            raise ClusterSpecError(
                f"ClusterSpec.memory_reserve: got {r!r}; must be a fraction in [0, 1) of device memory "
                f"(default {DEFAULT_MEMORY_RESERVE})"
            )
        object.__setattr__(self, "memory_reserve", float(r))
        bw = self.host_memory_bandwidth
        if bw is not None:
            if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0:
                raise ClusterSpecError(
                    f"ClusterSpec.host_memory_bandwidth: got {bw!r}; must be B/s (> 0) or None (unknown)"
                )
            object.__setattr__(self, "host_memory_bandwidth", float(bw))

    @property
    def host_step_bandwidth(self) -> float:
        """B/s of host memory one device's offloaded optimizer step gets: the node's
        ``host_memory_bandwidth`` shared by its devices (all step at once); unknown: the host link's."""
        if self.host_memory_bandwidth is None:
            return self.host_link.bandwidth
        return self.host_memory_bandwidth / self.devices_per_node

    def memory_limit(self, memory_limit_bytes: float | None = None) -> float:
        """Bytes per device a plan may use: ``memory_limit_bytes`` (default: the device's memory)
        less the reserve."""
        total = self.device.memory_bytes if memory_limit_bytes is None else memory_limit_bytes
        return total * (1 - self.memory_reserve)

    # ---------------------------------------------------------------- derived
    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def compute_slowdown(self) -> float:
        """How much slower each rank computes than the device's figures say: the
        ``devices_per_node`` CPU ranks of one node share ``device.contention.host_cores`` cores,
        ``max(1, devices_per_node / host_cores)`` (:meth:`HostContention.slowdown`); 1 without a
        contention model (accelerators) or where each rank has a core."""
        c = self.device.contention
        return c.slowdown(self.devices_per_node) if c is not None else 1.0

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
        intra, inter, host_mem, host_link, default_dpn, host_bw = _NODES[key]
        # CPU ranks: this host's cores
        device = _cpu_device() if _DEVICES[key].kind is DeviceKind.CPU else _DEVICES[key]
        return cls(
            name=key,
            nodes=nodes,
            devices_per_node=default_dpn if devices_per_node is None else devices_per_node,
            device=device,
            intra_node=intra,
            inter_node=inter,
            host_memory_bytes=host_mem,
            host_link=host_link,
            host_memory_bandwidth=_host_bandwidth(device, host_bw),
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
            "memory_reserve": self.memory_reserve,
            "host_memory_bandwidth": self.host_memory_bandwidth,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClusterSpec:
        """Inverse of ``to_dict``; unknown or missing keys raise ClusterSpecError naming them.
        Files written before ``DeviceSpec.contention`` (flat ``host_cores``, ``sync_wait`` and
        ``sync_wait_kinds`` device keys) load too, those keys into ``contention``; so do those
        written before ``DeviceSpec.kind`` (no ``"kind"`` device key), with the kind
        :func:`_legacy_kind` infers from the device's name."""
        _check_keys("cluster", d, _CLUSTER_KEYS, _CLUSTER_OPTIONAL)
        device = _device_from_dict("cluster.device", d["device"])
        links = {f: _link_from_dict(f"cluster.{f}", d[f]) for f in ("intra_node", "inter_node", "host_link")}
        return cls(
            name=d["name"],
            nodes=_coerce_number(d["nodes"]),
            devices_per_node=_coerce_number(d["devices_per_node"]),
            device=device,
            host_memory_bytes=_coerce_number(d["host_memory_bytes"]),
            memory_reserve=_coerce_number(d.get("memory_reserve", DEFAULT_MEMORY_RESERVE)),
            host_memory_bandwidth=(
                None if d.get("host_memory_bandwidth") is None else _coerce_number(d["host_memory_bandwidth"])
            ),
            **links,
        )

    @classmethod
    def _from_data(cls, data: Any, where: str) -> ClusterSpec:
        """A spec file's contents: a full ``to_dict()``, or a preset and the fields it overrides
        (``BASE_KEYS``, module docstring)."""
        if not isinstance(data, Mapping):
            raise ClusterSpecError(f"{where}: expected a mapping at top level, got {type(data).__name__}")
        given = [k for k in BASE_KEYS if k in data]
        if not given:
            if any(k not in data for k in _CLUSTER_KEYS if k not in _CLUSTER_OPTIONAL):
                _check_base_hint(data)
            return cls.from_dict(data)
        if len(given) > 1:
            raise ClusterSpecError(f"cluster: give the preset once, as 'base' (got both {given})")
        over = dict(data)
        preset = over.pop(given[0])
        key = preset.strip().lower() if isinstance(preset, str) else None
        if key not in _DEVICES:
            raise ClusterSpecError(
                f"cluster.base: unknown preset {preset!r}{did_you_mean(key, PRESET_NAMES)}; "
                f"presets are {list(PRESET_NAMES)}"
            )
        _check_keys("cluster", data, ("base", *_CLUSTER_KEYS), ("base", *_CLUSTER_KEYS), ("preset",))
        nodes = _coerce_number(over.pop("nodes", 1))
        dpn = over.pop("devices_per_node", None)
        base = cls.preset(key, nodes=nodes, devices_per_node=None if dpn is None else _coerce_number(dpn))
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
        """Load a spec file (.json/.yaml/.yml): a full ``to_dict()``, or ``{"base": PRESET, ...}``:
        the preset (``nodes`` and ``devices_per_node`` as ``preset()`` takes them) with the fields
        given replaced, a nested mapping (``device``, a link, ``device.contention``) merged key by
        key into the preset's."""
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
            device = _cpu_device()
        else:
            props = torch.cuda.get_device_properties(0)
            gpu_name = torch.cuda.get_device_name(0)
            preset = _gpu_preset_for(gpu_name, int(props.total_memory))
            device = _gpu_device(gpu_name, int(props.total_memory))
        intra, inter, host_mem, host_link, _, host_bw = _NODES[preset]
        return cls(
            name=name,
            nodes=world // dpn,
            devices_per_node=dpn,
            device=device,
            intra_node=intra,
            inter_node=inter,
            host_memory_bytes=host_mem,
            host_link=host_link,
            host_memory_bandwidth=_host_bandwidth(device, host_bw),
        )
