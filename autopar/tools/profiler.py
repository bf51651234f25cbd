"""Per-op profiler: measured seconds for an op on one rank's local shapes, cached on disk.

What is measured
----------------
For one graph node under one strategy, the op (``node.target``, an aten overload) runs on this
machine's device with synthesized inputs of the *local* shapes the strategy gives one rank (each
dim cut by ``Shard(d)`` on mesh axis ``a`` divided by ``mesh_shape[a]``; Replicate and Partial
inputs keep the global shape), the graph's dtypes, storage order and broadcast (stride-0) dims,
and the node's own non-tensor arguments. Its figure is

    t = t_fwd + t_bwd                                                                    [s]

* ``t_fwd``: the op called with autograd recording (as a training step calls it);
* ``t_bwd``: ``torch.autograd.grad`` of its floating outputs with respect to the inputs that need a
  gradient (those whose producers need one: ``NodeInfo.requires_grad``), given random output
  gradients: the backward kernels the step runs for this op; 0 when no output needs a gradient.

Each is the median of ``repeats`` samples after ``warmup`` calls; a sample loops the call until
it lasts ``min_sample_s`` (at most ``MAX_INNER`` calls) and divides by the count, so
microsecond ops are not lost in timer resolution. On CUDA every sample ends with
``torch.cuda.synchronize()``. ``t`` is comparable to ``cost_model.compute.node_time`` (forward +
backward of one rank, dispatch overhead included). What a lowering adds around the op (a mean's
division over a split dim, a vocabulary-parallel embedding's mask, collectives) is not in it.

Which ops
---------
Only ops in ``PROFILED_OPS``: their non-tensor arguments (dims, flags, epsilons, equations) mean
the same on a local piece as on the whole tensor (matmul family, convolutions, attention,
softmax, norms, embedding, losses, elementwise ops, reductions over dims, views by dims). Ops whose
arguments hold sizes (view, reshape, expand, slice, split, factories ...), with no tensor input, or
with a non-tensor graph value as argument keep the analytical figure (``node_time`` returns None).
Inputs are ``uniform[0.5, 1.5)`` floats (safe for log, sqrt, reciprocal), random booleans, and
integers in ``[1, 3)``, except indices: embedding ids in ``[0, rows of the local table)`` and
loss targets in ``[0, classes)``. An op that raises on its synthesized inputs, or whose inputs
and outputs would exceed ``max_bytes``, keeps the analytical figure; a raising op is remembered
in the cache (with its error) and not run again.

Cache
-----
Timings are kept in a JSON file shared by runs and processes (``cost_model.profile_cache``),
under a context ``"<device type>:<device name>|torch <version>|threads <n>"`` and an op key
``"<op>(<args>){<kwargs>}"``: the node's arguments with every tensor written as
``dtype[local shape]`` plus, where they apply, its storage order ``{perm=[...]}``, broadcast dims
``{expanded=[...]}``, integer value range ``{high=n}`` and ``+grad`` when it needs a gradient, e.g.
``aten.linear.default(float32[4, 64, 128], float32[512, 128]+grad, float32[512]+grad){}``.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.cluster import ClusterSpec, DeviceKind, DeviceSpec
from autopar.errors import ProfilerDeviceError
from autopar.passes.rules import tensor_inputs
from autopar.passes.rules.elementwise import UNARY_LINEAR, UNARY_NONLINEAR
from autopar.placement import local_shapes
from autopar.tools.profile_cache import OpTiming, ProfileCache, context, cpu_name, default_cache_path

log = logging.getLogger(__name__)
aten = torch.ops.aten

MAX_INNER = 1000
PROGRESS_EVERY_S = 10.0

PROFILED_OPS = frozenset(
    [
        aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.matmul.default,
        aten.linear.default, aten.einsum.default,
        aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default,
        aten.scaled_dot_product_attention.default,
        aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
        aten.layer_norm.default, aten.rms_norm.default, aten.native_layer_norm.default,
        aten.embedding.default, aten.cross_entropy_loss.default, aten.nll_loss.default, aten.mse_loss.default,
        aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor,
        aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar,
        aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default,
        aten.amin.default, aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default,
        aten.cumsum.default, aten.cat.default,
        aten.transpose.int, aten.permute.default, aten.t.default, aten.unsqueeze.default,
        aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints,
        aten.broadcast_tensors.default,
        *UNARY_LINEAR, *UNARY_NONLINEAR,
    ]
)  # fmt: skip

# integer inputs that index something: (op, input position) -> (input position, dim) whose local
# size bounds the values; -1 as dim means "dim 1, or dim 0 for a 1-D input" (loss classes)
_INDEX_INPUTS = {
    (aten.embedding.default, 1): (0, 0),
    (aten.cross_entropy_loss.default, 1): (0, -1),
    (aten.nll_loss.default, 1): (0, -1),
}


@dataclass(frozen=True, repr=False)
class TensorSpec:
    """A tensor to synthesize: local shape, dtype, layout, and whether it needs a gradient."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False
    perm: tuple[int, ...] | None = None  # dims from outermost to innermost in memory; None: contiguous
    expanded: tuple[int, ...] = ()  # dims broadcast with stride 0
    high: int | None = None  # integer values drawn from [0, high)

    def __post_init__(self) -> None:
        if any(int(s) < 0 for s in self.shape):
            raise ValueError(f"TensorSpec.shape: got {self.shape}; sizes must be >= 0")
        if self.perm is not None and sorted(self.perm) != list(range(len(self.shape))):
            raise ValueError(f"TensorSpec.perm: got {self.perm}; must permute range({len(self.shape)})")

    def __repr__(self) -> str:  # the op key's text for this tensor
        s = f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"
        if self.perm is not None:
            s += f"{{perm={list(self.perm)}}}"
        if self.expanded:
            s += f"{{expanded={list(self.expanded)}}}"
        if self.high is not None:
            s += f"{{high={self.high}}}"
        return s + ("+grad" if self.requires_grad else "")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def make(self, device: torch.device) -> torch.Tensor:
        nd = len(self.shape)
        base = [1 if d in self.expanded else s for d, s in enumerate(self.shape)]
        perm = self.perm or tuple(range(nd))
        stored = [base[p] for p in perm]
        if self.dtype.is_floating_point:
            t = torch.rand(stored, device=device).to(self.dtype) + 0.5
        elif self.dtype is torch.bool:
            t = torch.rand(stored, device=device) < 0.5
        elif self.high is not None:
            t = torch.randint(0, max(self.high, 1), stored, device=device, dtype=self.dtype)
        else:
            t = torch.randint(1, 3, stored, device=device, dtype=self.dtype)
        if self.requires_grad:
            t.requires_grad_(True)  # the stored leaf; the views below are what the op gets
        if self.perm is not None:
            t = t.permute([perm.index(d) for d in range(nd)])
        if self.expanded:
            t = t.expand(self.shape)
        return t


@dataclass(frozen=True)
class ProfileStats:
    """Counts since the last ``take_stats``: lookups answered by a run, the cache, or neither."""

    measured: int = 0  # distinct ops run now
    cached: int = 0  # answered from the cache (disk, or measured earlier in this process)
    failed: int = 0  # raised on synthesized inputs (now or in the cache): analytical figure used
    skipped: int = 0  # not profiled (args hold sizes, too large, ...): analytical figure used
    seconds: float = 0.0  # spent measuring

    def line(self) -> str:
        return (
            f"{self.measured} distinct ops measured in {self.seconds:.1f} s, {self.cached} cache hits, "
            f"{self.failed} failed and {self.skipped} not profiled (analytical figure kept)"
        )


_GPU_FAMILIES = ("GB200", "B200", "H200", "H100", "A100", "L40S", "A10G", "V100", "MI300X", "MI250")


def _gpu_family(name: str) -> str:
    upper = name.upper()
    return next((f for f in _GPU_FAMILIES if f in upper), upper.strip())


def profile_device_for(device: DeviceSpec) -> torch.device:
    """The local torch device whose measurements stand for ``device``; ProfilerDeviceError if none."""
    fix = (
        "plan with a spec of this machine (ClusterSpec.local() under torchrun, the 'cpu' preset, or the "
        "file `autopar calibrate` writes), run the planning on a machine with that device, or drop "
        "profile=True / --profile to use the analytical compute model"
    )
    if device.kind is DeviceKind.CPU:
        return torch.device("cpu")
    if device.kind is not DeviceKind.CUDA:
        raise ProfilerDeviceError(
            f"profiling has no local device for device kind {device.kind.name} ({device.name!r}): "
            f"add one to profile_device_for (autopar/tools/profiler.py), or {fix}"
        )
    if not torch.cuda.is_available():
        raise ProfilerDeviceError(
            f"profiling measures ops on this machine, which has no GPU (cpu: {cpu_name()}), but the cluster's "
            f"device is {device.name!r}: the figures would not describe it; {fix}"
        )
    local = torch.cuda.get_device_name(torch.cuda.current_device())
    if _gpu_family(local) != _gpu_family(device.name):
        raise ProfilerDeviceError(
            f"profiling measures ops on this machine's {local!r}, but the cluster's device is "
            f"{device.name!r}: the figures would not describe it; {fix}"
        )
    return torch.device("cuda", torch.cuda.current_device())


@dataclass
class OpProfiler:
    """Measures ops on the local ``device`` (see the module docstring) and caches them in
    ``cache_path`` (default ``~/.cache/autopar/op_profile.json``).

    ``num_threads``: intra-op threads while measuring (default: the current setting; ``for_cluster``
    uses 1 on CPU, as CPU ranks run). ``warmup``, ``repeats``, ``min_sample_s``: see the module
    docstring. ``max_bytes``: ops whose tensors would take more keep the analytical figure.
    ``progress``: called with a line every ``PROGRESS_EVERY_S`` seconds of profiling.
    """

    device: torch.device | str = "cpu"
    cache_path: str | os.PathLike | None = None
    num_threads: int | None = None
    warmup: int = 2
    repeats: int = 5
    min_sample_s: float = 2e-3
    max_bytes: int = 2**30
    progress: Callable[[str], None] | None = None
    runs: int = field(default=0, init=False)  # op executions, warmup and samples included
    cache: ProfileCache = field(init=False, repr=False)
    _stats: ProfileStats = field(default_factory=ProfileStats, init=False, repr=False)
    _last_report: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.device.type not in ("cpu", "cuda"):
            raise ProfilerDeviceError(f"OpProfiler.device: got {self.device}; profile on 'cpu' or 'cuda'")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ProfilerDeviceError(
                "OpProfiler.device: 'cuda' asked for but CUDA is not available; use 'cpu'"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"OpProfiler.num_threads: got {self.num_threads}; must be >= 1 or None")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"OpProfiler: repeats {self.repeats} must be >= 1 and warmup {self.warmup} >= 0")
        self.cache_path = Path(self.cache_path) if self.cache_path is not None else default_cache_path()
        self.cache = ProfileCache(self.cache_path, context(self.device, self.num_threads))

    @classmethod
    def for_cluster(cls, cluster: ClusterSpec, **kw) -> OpProfiler:
        """A profiler on the local device that stands for ``cluster.device`` (ProfilerDeviceError if
        none). On CPU it measures with one intra-op thread unless ``num_threads`` is given: CPU ranks
        run so (torchrun and ``autopar.launch`` set one thread per process), and on a loaded machine
        a multi-threaded op waits for descheduled threads (up to a scheduler time slice per op)."""
        device = profile_device_for(cluster.device)
        if device.type == "cpu" and kw.get("num_threads") is None:
            kw["num_threads"] = 1
        return cls(device=device, **kw)

    def check_cluster(self, cluster: ClusterSpec) -> None:
        """Raise ProfilerDeviceError when this profiler's device does not stand for the cluster's."""
        want = profile_device_for(cluster.device)
        if want.type != self.device.type:
            raise ProfilerDeviceError(
                f"this OpProfiler measures on {self.device}, but the cluster's device {cluster.device.name!r} "
                f"is profiled on {want.type}; build it with OpProfiler.for_cluster(cluster)"
            )

    # ------------------------------------------------------------------------------ graph nodes
    def node_time(self, node: fx.Node, strategy, mesh_shape: Sequence[int], infos: dict) -> float | None:
        """Forward + backward seconds of ``node`` on one rank under ``strategy`` (a
        ``passes.strategies.Strategy``), or None where the analytical figure must be kept."""
        call = self.node_call(node, strategy, mesh_shape, infos)
        if call is None:
            self._count(skipped=1)
            return None
        timing = self.time_op(*call)
        return timing.total_s if timing is not None and timing.ok else None

    def node_call(self, node: fx.Node, strategy, mesh_shape: Sequence[int], infos: dict):
        """``(op, args, kwargs)`` with TensorSpec leaves of the local shapes, or None (not profiled)."""
        if node.op != "call_function" or node.target not in PROFILED_OPS:
            return None
        inputs = tensor_inputs(node)
        if not inputs or len(inputs) != len(strategy.ins):
            return None
        locals_ = local_shapes([a.meta["val"].shape for a in inputs], strategy.ins, mesh_shape)
        if locals_ is None:
            return None  # an uneven split: strategies never make one, but never guess
        specs: list[TensorSpec] = []  # in rules.tensor_inputs order: the order of strategy.ins
        for i, (a, shape) in enumerate(zip(inputs, locals_)):
            v = a.meta["val"]
            high = None
            bound = _INDEX_INPUTS.get((node.target, i))
            if bound is not None and not v.dtype.is_floating_point:
                src = locals_[bound[0]]
                dim = bound[1] if bound[1] >= 0 else (1 if len(src) >= 2 else 0)
                high = src[dim] if src else 1
            perm, expanded = _layout(v)
            rg = bool(v.dtype.is_floating_point and a.name in infos and infos[a.name].requires_grad)
            specs.append(TensorSpec(tuple(shape), v.dtype, rg, perm, expanded, high))
        queue = iter(specs)
        other_nodes = False

        def leaf(x):
            nonlocal other_nodes
            if isinstance(x, fx.Node):
                if isinstance(x.meta.get("val"), torch.Tensor):
                    return next(queue)  # the same flattening as tensor_inputs
                other_nodes = True  # a non-tensor graph value (a SymInt ...): its value is unknown here
                return None
            return self.device if isinstance(x, torch.device) else x

        args, kwargs = pytree.tree_map(leaf, (node.args, node.kwargs))
        return None if other_nodes else (node.target, args, kwargs)

    # ------------------------------------------------------------------------------ ops
    def time_op(self, op, args: tuple, kwargs: dict | None = None) -> OpTiming | None:
        """Measured timing of ``op(*args, **kwargs)`` with TensorSpec leaves (cached), or None when
        its tensors would exceed ``max_bytes``."""
        kwargs = kwargs or {}
        key = op_key(op, args, kwargs)
        hit = self.cache.get(key)
        if hit is not None:
            self._count(cached=1, failed=0 if hit.ok else 1)
            return hit
        specs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, TensorSpec)]
        if 3 * sum(s.nbytes for s in specs) > self.max_bytes:  # inputs, outputs and gradients, roughly
            self._count(skipped=1)
            return None
        t0 = time.perf_counter()
        try:
            cuda = [self.device] if self.device.type == "cuda" else []
            # forked RNG: planning with profiling leaves the caller's random streams as they were
            with self._threads(), torch.enable_grad(), torch.random.fork_rng(devices=cuda):
                timing = self._measure(op, args, kwargs)
        except Exception as e:  # noqa: BLE001 - any failure keeps the analytical figure (remembered)
            log.debug("profiling %s failed: %s", key, e)
            timing = OpTiming(
                0.0, 0.0, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            )
        self.cache.put(key, timing)
        self._count(measured=1, failed=0 if timing.ok else 1, seconds=time.perf_counter() - t0)
        now = time.perf_counter()
        if not self._last_report:
            self._last_report = t0
        if self.progress is not None and now - self._last_report > PROGRESS_EVERY_S:
            self._last_report = now
            self.progress(f"profile: {self._stats.measured} distinct ops measured so far (last: {op})")
        return timing

    def _measure(self, op, args, kwargs) -> OpTiming:
        dev = self.device
        tensors: list[torch.Tensor] = []

        def make(x):
            if isinstance(x, TensorSpec):
                t = x.make(dev)
                if x.requires_grad:
                    tensors.append(t)
                return t
            return x

        call_args, call_kwargs = pytree.tree_map(make, (args, kwargs))
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

        def forward():
            self.runs += 1
            return op(*call_args, **call_kwargs)

        out = [t for t in pytree.tree_leaves(forward()) if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = [torch.rand_like(t) for t in out]

        def step():
            outs = [
                t for t in pytree.tree_leaves(forward()) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            torch.autograd.grad(outs, tensors, grads, allow_unused=True)

        t_fwd = self._median(forward, sync)
        t_step = self._median(step, sync) if out and tensors else t_fwd
        return OpTiming(t_fwd, max(t_step - t_fwd, 0.0))

    def _median(self, fn: Callable[[], object], sync: Callable[[], None]) -> float:
        for _ in range(self.warmup):
            fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        once = time.perf_counter() - t0
        inner = max(1, min(MAX_INNER, math.ceil(self.min_sample_s / max(once, 1e-9))))
        samples = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            sync()
            samples.append((time.perf_counter() - t0) / inner)
        return statistics.median(samples)

    @contextmanager
    def _threads(self):
        before = torch.get_num_threads()
        if self.num_threads is not None and self.num_threads != before:
            torch.set_num_threads(self.num_threads)
        try:
            yield
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)

    # ------------------------------------------------------------------------------ bookkeeping
    def _count(self, **kw) -> None:
        s = self._stats
        self._stats = ProfileStats(
            **{k: getattr(s, k) + kw.get(k, 0) for k in ProfileStats.__dataclass_fields__}
        )

    def take_stats(self) -> ProfileStats:
        """Counts since the last call (and resets them)."""
        s, self._stats = self._stats, ProfileStats()
        return s

    def flush(self) -> None:
        """Write this process's new measurements to the cache file (see ``ProfileCache.flush``)."""
        self.cache.flush()


def op_key(op, args: tuple, kwargs: dict) -> str:
    """The cache's key of ``op(*args, **kwargs)`` with TensorSpec leaves (see the module docstring)."""
    return f"{op}{tuple(args)!r}{dict(kwargs)!r}"


def _layout(v: torch.Tensor) -> tuple[tuple[int, ...] | None, tuple[int, ...]]:
    """Storage order (outermost first; None when contiguous) and stride-0 dims of a traced value."""
    nd = v.dim()
    try:
        stride = v.stride()
    except (RuntimeError, NotImplementedError):
        return None, ()  # sparse / nested values have no strides: synthesize them contiguous
    shape = v.shape
    expanded = tuple(d for d in range(nd) if stride[d] == 0 and shape[d] > 1)
    # size-1 and broadcast dims may have any stride: keep them in place; order the rest by stride
    slots = [d for d in range(nd) if shape[d] > 1 and stride[d] != 0]
    big = sorted(slots, key=lambda d: (-stride[d], d))
    perm = list(range(nd))
    for slot, d in zip(slots, big):
        perm[slot] = d
    perm_t = tuple(perm)
    return (None if perm_t == tuple(range(nd)) else perm_t), expanded


def resolve_profiler(
    profile: bool | OpProfiler, cluster: ClusterSpec, progress: Callable[[str], None] | None = None
) -> OpProfiler | None:
    """``search``'s ``profile=`` argument as a profiler for ``cluster`` (None when False)."""
    if profile is False or profile is None:
        return None
    if profile is True:
        return OpProfiler.for_cluster(cluster, progress=progress)
    if isinstance(profile, OpProfiler):
        profile.check_cluster(cluster)
        return profile
    raise TypeError(f"profile: got {profile!r}; pass True, False or an OpProfiler")
