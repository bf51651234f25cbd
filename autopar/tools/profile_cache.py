"""The op profiler's on-disk cache: measured op timings keyed by machine and op, shared by processes.

One JSON file (default ``$XDG_CACHE_HOME/autopar/op_profile.json``, else
``~/.cache/autopar/op_profile.json``)::

    {"format": "autopar-op-profile", "version": 1,
     "entries": {CONTEXT: {OP_KEY: {"forward_s": s, "backward_s": s, "error": ""}}}}

* ``CONTEXT`` = ``"<device type>:<device name>|torch <version>|threads <n>"``, e.g.
  ``"cpu:Intel(R) Xeon(R) ...|torch 2.13.0+cpu|threads 1"`` (``context``): a figure is reused only
  on the same device model, torch build and intra-op thread count;
* ``OP_KEY``: the op and its arguments as ``autopar.tools.profiler`` writes them (tensors as
  ``dtype[local shape]`` with layout, value range and gradient marks);
* ``forward_s`` / ``backward_s``: seconds; ``error``: non-empty when the op raised on synthesized
  inputs (the planner keeps the analytical figure and does not run it again).

Writes (``ProfileCache.flush``) re-read the file and merge this process's new entries into it under
an exclusive ``flock`` on ``<file>.lock`` (POSIX; elsewhere writes are only atomic), then write a
temporary file in the same folder and ``os.replace`` it over the cache: the replace is atomic, so
concurrent ranks or processes never see a half-written file, and the lock keeps one writer from
dropping another's entries.
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autopar.errors import ProfileCacheError

CACHE_FORMAT = "autopar-op-profile"
CACHE_VERSION = 1


@dataclass(frozen=True)
class OpTiming:
    """One op's measured forward and backward seconds on one rank; ``error`` when it could not run."""

    forward_s: float
    backward_s: float
    error: str = ""

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"OpTiming.{name}: got {v!r}; must be a finite number of seconds >= 0")

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    def to_dict(self) -> dict[str, Any]:
        return {"forward_s": self.forward_s, "backward_s": self.backward_s, "error": self.error}

    @classmethod
    def from_dict(cls, d: Any) -> OpTiming:
        return cls(float(d["forward_s"]), float(d["backward_s"]), str(d.get("error", "")))


def default_cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "autopar" / "op_profile.json"


def cpu_name() -> str:
    """The CPU model ("Intel(R) Xeon(R) ..."), from /proc/cpuinfo on Linux, else ``platform``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: platform's answer below
    return platform.processor() or platform.machine() or "unknown cpu"


def context(device: torch.device, num_threads: int | None = None) -> str:
    """The cache's machine key: device type and model, torch version, intra-op threads."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return f"{device.type}:{name}|torch {torch.__version__}|threads {num_threads or torch.get_num_threads()}"


@contextmanager
def _locked(path: Path):
    """Exclusive lock on ``path`` + '.lock' (POSIX flock; elsewhere the replace is only atomic)."""
    if os.name != "posix":
        yield
        return
    import fcntl  # POSIX only

    with open(str(path) + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_entries(path: Path) -> dict[str, dict[str, dict]]:
    """Every context's entries in the cache file (empty when there is none)."""
    if not path.exists():
        return {}
    fix = f"delete {str(path)!r} (it is only a cache) or pass another cache path (--profile-cache)"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileCacheError(f"op profile cache {str(path)!r} is not readable JSON ({e}); {fix}") from None
    if (
        not isinstance(data, dict)
        or data.get("format") != CACHE_FORMAT
        or not isinstance(data.get("entries"), dict)
    ):
        raise ProfileCacheError(f"{str(path)!r} is not an autopar op profile cache; {fix}")
    if data.get("version") != CACHE_VERSION:
        raise ProfileCacheError(
            f"op profile cache {str(path)!r} has version {data.get('version')!r}, this autopar reads "
            f"version {CACHE_VERSION}; {fix}"
        )
    return data["entries"]


@dataclass
class ProfileCache:
    """The entries of one context, loaded from ``path``; ``put`` adds, ``flush`` writes them back."""

    path: Path
    context: str
    _entries: dict[str, OpTiming] = field(default_factory=dict, init=False, repr=False)
    _new: dict[str, OpTiming] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        stored = read_entries(self.path).get(self.context, {})
        try:
            self._entries = {k: OpTiming.from_dict(v) for k, v in stored.items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileCacheError(
                f"op profile cache {str(self.path)!r} has a malformed entry ({e}); delete the file "
                "(it is only a cache) or pass another cache path (--profile-cache)"
            ) from None

    def get(self, key: str) -> OpTiming | None:
        return self._entries.get(key)

    def put(self, key: str, timing: OpTiming) -> None:
        self._entries[key] = self._new[key] = timing

    def __len__(self) -> int:
        return len(self._entries)

    def flush(self) -> None:
        """Merge the entries put since the last flush into the file (locked, atomic replace), and take
        in the entries other processes wrote there since this cache was loaded."""
        if not self._new:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(self.path):
            entries = read_entries(self.path)
            ours = entries.setdefault(self.context, {})
            for k, v in ours.items():  # what other processes measured meanwhile serves this one too
                if k not in self._entries:
                    self._entries[k] = OpTiming.from_dict(v)
            ours.update({k: t.to_dict() for k, t in self._new.items()})
            data = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "entries": entries}
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        self._new.clear()
