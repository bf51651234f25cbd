"""Single-op reference times against the cost model: each measured op priced as a plan prices it,
and a GPU preset's figures fitted to them (``benchmarks/bench_gpu_preset.py`` prints both).

Reference rows (``load_samples``): ``cost_model/reference/h100_ops.jsonl`` (README there: one NVIDIA
H100 80GB HBM3, torch 2.11.0+cu130, CUDA events, median; ``op_sweep.py`` beside it measured them),
one :class:`Sample` per measured time: ``mm`` (M, N, K) ``torch.mm`` of (M, K) by (K, N) in bf16
or fp32 (and ``float32_tf32``, which no preset prices as TF32: float32 matmuls run without it,
torch's default); ``sdpa_causal`` (batch, heads, seq, head_dim) forward and forward + backward;
``add``, ``mul_scalar``, ``gelu``, ``silu``, ``copy`` over ``numel``; ``layer_norm``, ``rms_norm``,
``softmax`` over (rows, 4096); ``cross_entropy`` (tokens, vocab) forward and forward + backward;
``adam_foreach``, ``adam_fused`` steps over ``numel`` parameters in tensors of ``ADAM_TENSOR``
elements.

Pricing (``predict``): the rows' ops are traced side by side as one module per kind of row, on
the meta device (``passes/trace.py``), analyzed (``passes/analyze.py``), and each op node priced by
``passes/costs.analytical_node_time`` on one device (work divided by 1): forward rows take plain
inputs (nothing needs a gradient: a node costs its forward), forward + backward rows take the
tensors that get a gradient as parameters (q, k, v; the logits). Adam rows: one
``cost_model.compute.optimizer_step_time`` per parameter tensor, as ``passes/costs.py`` prices a
step; it models PyTorch's default step (``foreach`` on GPUs), so ``adam_fused`` rows are shown,
not fitted.

Fit (``fit_figures``): a device's figures from the rows, each through the cost model's own formula
(``cost_model/compute.py``), with the counts (bytes ``B``, FLOPs ``F``, smallest GEMM size ``d``,
elements ``E``) read off the analyzed nodes, as a plan reads them. Rounded to
``SIGNIFICANT`` digits: one card on one day says no more.

1. ``kernel_launch_s`` L and ``memory_bandwidth`` bw: ``t = L + B / bw`` over the elementwise rows
   (``ELEMENTWISE``; B = bytes read + written), least squares of the relative error (linear in L
   and 1 / bw);
2. ``matmul_dim_half`` D and ``matmul_overhead_s`` o: ``t = L + (F + peak T_HALF) / (peak EFF_MAX)
   (d + D) / d + o`` over the bf16 and fp32 ``mm`` rows: for each D of ``DIM_HALF_GRID`` the
   o >= 0 of least squared relative error, then the D of least error. The efficiency is not a
   device field: ``efficiency`` fits it free per dtype with the same D and o, a check of
   ``EFF_MAX`` (``tests/test_gpu_preset.py`` holds it within ``EFF_TOLERANCE``);
3. ``pointwise_s`` of the ops whose time is neither their bytes at bw nor their FLOPs
   (``POINTWISE``: layer_norm, rms_norm, softmax, cross_entropy), over the rows of at least
   ``LARGE_ELEMENTS`` elements (smaller ones are a launch or two, which no per-element figure
   prices): the forward figure among the rows' own ``(t - L) / E`` and 0 (the roofline) whose
   priced forward times have the least squared relative error; the backward figure likewise
   from the forward + backward rows where measured (cross_entropy), else 0 (the roofline). The
   table is per op, not per dtype: where bf16 and fp32 differ per element, it fits one of them;
4. ``optimizer_param_s["ADAM"]``: the median over the ``adam_foreach`` rows of what one tensor's
   step takes beyond its bytes, ``t / n - P (a + f) / bw`` (``compute.OPTIMIZER_TRAFFIC``; n
   tensors of P bytes).

Not fitted: attention. ``torch.utils.flop_counter`` counts a causal ``scaled_dot_product_attention``
as the full one (twice the work a causal kernel does), so at the matmul efficiency the roofline
already prices the ``sdpa_causal`` rows at or above their measured time from sequence 2048 on,
and a ``per_flop_s`` figure can only price an op slower than its roofline. Traced Hugging Face
models call it with a boolean mask instead, which runs other kernels than these rows measured.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn.functional as F

import autopar.cost_model
from autopar.cluster import DeviceKind, DeviceSpec
from autopar.cost_model.compute import EFF_MAX, OPTIMIZER_TRAFFIC, T_HALF, gemm_min_dim, optimizer_step_time
from autopar.errors import ReferenceDataError
from autopar.passes.analyze import NodeInfo, analyze
from autopar.passes.costs import analytical_node_time
from autopar.passes.op_price import node_elements
from autopar.passes.rules import tensor_inputs
from autopar.passes.trace import trace

__all__ = [
    "H100_OPS",
    "Sample",
    "Figures",
    "load_samples",
    "predict",
    "fit_figures",
    "efficiency",
    "errors",
    "summary",
    "describe",
    "round_sig",
]

H100_OPS = Path(autopar.cost_model.__file__).parent / "reference" / "h100_ops.jsonl"

ELEMENTWISE = ("add", "mul_scalar", "gelu", "silu", "copy")
POINTWISE = {
    "layer_norm": "aten.layer_norm.default",
    "rms_norm": "aten.rms_norm.default",
    "softmax": "aten.softmax.int",
    "cross_entropy": "aten.cross_entropy_loss.default",
}
ADAM_TENSOR = 2**22  # elements per parameter tensor of the sweep's Adam steps (op_sweep.py)
LARGE_ELEMENTS = 2**24
DIM_HALF_GRID = (0, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
SIGNIFICANT = 3
EFF_TOLERANCE = 0.05  # |fitted efficiency - EFF_MAX| the module-wide constant may be off by


@dataclass(frozen=True)
class Sample:
    """One measured time: ``op`` as the sweep names it, ``dtype`` name, ``shape`` (the sweep's
    (M, N, K), (batch, heads, seq, head_dim), (numel,), (rows, cols) or (tokens, vocab)),
    ``backward``: forward + backward rather than forward alone, ``seconds`` measured."""

    op: str
    dtype: str
    shape: tuple[int, ...]
    backward: bool
    seconds: float

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ReferenceDataError(f"{self.op} {self.shape}: measured {self.seconds!r} s; must be > 0")

    @property
    def family(self) -> str:
        """The row's group in the tables: ``mm bfloat16``, ``elementwise``, ``sdpa_causal fwd_bwd``..."""
        if self.op == "mm":
            return f"mm {self.dtype}"
        if self.op in ELEMENTWISE:
            return "elementwise"
        if self.op in ("sdpa_causal", "cross_entropy"):
            return f"{self.op} {'fwd_bwd' if self.backward else 'fwd'}"
        return self.op

    @property
    def large_gemm(self) -> bool:
        """An ``mm`` row whose every size is at least 1024 (no launch- or wave-bound GEMM)."""
        return self.op == "mm" and min(self.shape) >= 1024


def load_samples(path: str | Path = H100_OPS) -> tuple[Sample, ...]:
    """The rows of a reference file as samples (a row with forward and forward + backward times
    gives two); the ``device`` row is skipped."""
    samples = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if row["op"] == "device":
            continue
        base = (row["op"], row["dtype"], tuple(int(s) for s in row["shape"]))
        if "ms" in row:
            samples.append(Sample(*base, False, row["ms"] * 1e-3))
        if "fwd_ms" in row:
            samples.append(Sample(*base, False, row["fwd_ms"] * 1e-3))
        if "fwd_bwd_ms" in row:
            samples.append(Sample(*base, True, row["fwd_bwd_ms"] * 1e-3))
    return tuple(samples)


# --------------------------------------------------------------------------------------------------
# each sample's op as a plan sees it: traced, analyzed, priced per node
# --------------------------------------------------------------------------------------------------


def _meta(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype)


def _dtype(sample: Sample) -> torch.dtype:
    return getattr(torch, sample.dtype.removesuffix("_tf32"))


# op -> (function of the tensors, the tensors as (value, gets a gradient in a backward row))
def _call(s: Sample) -> tuple[Callable, list[tuple[torch.Tensor, bool]]]:
    dt, sh = _dtype(s), s.shape
    if s.op == "mm":
        m, n, k = sh
        return torch.mm, [(_meta((m, k), dt), False), (_meta((k, n), dt), False)]
    if s.op == "sdpa_causal":
        qkv = [(_meta(sh, dt), True) for _ in range(3)]
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), qkv
    if s.op == "cross_entropy":
        target = torch.empty(sh[0], device="meta", dtype=torch.long)
        return F.cross_entropy, [(_meta(sh, dt), True), (target, False)]
    unary = {
        "mul_scalar": lambda x: x * 0.5,
        "gelu": F.gelu,
        "silu": F.silu,
        "copy": lambda x: x.clone(),
        "softmax": lambda x: torch.softmax(x, -1),
    }
    if s.op in unary:
        return unary[s.op], [(_meta(sh, dt), False)]
    if s.op == "add":
        return torch.add, [(_meta(sh, dt), False), (_meta(sh, dt), False)]
    row, last = (_meta(sh, dt), False), (_meta(sh[-1:], dt), False)
    if s.op == "layer_norm":
        return lambda x, w, b: F.layer_norm(x, sh[-1:], w, b), [row, last, (_meta(sh[-1:], dt), False)]
    if s.op == "rms_norm":
        return lambda x, w: F.rms_norm(x, sh[-1:], w), [row, last]
    known = ["mm", "sdpa_causal", *ELEMENTWISE, *POINTWISE, "adam_foreach", "adam_fused"]
    raise ReferenceDataError(f"reference op {s.op!r}: no pricing for it (known: {', '.join(known)})")


class _SideBySide(torch.nn.Module):
    """Several samples' ops in one forward, each on its own tensors; the tensors that get a
    gradient (in a backward sample) are parameters, the rest inputs."""

    def __init__(self, samples: Sequence[Sample]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList()
        self.calls: list[tuple[Callable, list[tuple[str, int]]]] = []
        self.inputs: list[torch.Tensor] = []
        for s in samples:
            fn, tensors = _call(s)
            refs = []
            for t, grad in tensors:
                if grad and s.backward:
                    refs.append(("p", len(self.params)))
                    self.params.append(torch.nn.Parameter(t))
                else:
                    refs.append(("i", len(self.inputs)))
                    self.inputs.append(t)
            self.calls.append((fn, refs))

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(
            fn(*[self.params[j] if kind == "p" else inputs[j] for kind, j in refs]) for fn, refs in self.calls
        )


@dataclass(frozen=True)
class _Priced:
    """A sample's op nodes and the analysis of their graph."""

    nodes: tuple[fx.Node, ...]
    infos: dict[str, NodeInfo]

    def time(self, device: DeviceSpec) -> float:
        return sum(
            analytical_node_time(self.infos[n.name], tensor_inputs(n), self.infos, device, 1)
            for n in self.nodes
        )

    @property
    def node(self) -> tuple[NodeInfo, list[fx.Node]]:
        """The sample's one op node (its info and tensor inputs)."""
        if len(self.nodes) != 1:
            raise ReferenceDataError(f"expected one op node, got {[str(n.target) for n in self.nodes]}")
        return self.infos[self.nodes[0].name], tensor_inputs(self.nodes[0])


_GRAPHS: dict[Sample, _Priced] = {}


def _graphs(samples: Iterable[Sample]) -> dict[Sample, _Priced]:
    """Each traced sample's op nodes, tracing those not yet traced: one module per (op, dtype,
    backward), its outputs in the samples' order."""
    todo: dict[tuple, list[Sample]] = {}
    for s in samples:
        if s not in _GRAPHS and not s.op.startswith("adam"):
            todo.setdefault((s.op, s.dtype, s.backward), []).append(s)
    for group in todo.values():
        module = _SideBySide(group)
        tg = trace(module, tuple(module.inputs))
        infos = analyze(tg)
        out = next(n for n in tg.graph.nodes if n.op == "output")
        for s, result in zip(group, out.args[0]):
            seen, stack = [], [result]
            while stack:  # the op nodes this output depends on (the samples share no tensor)
                n = stack.pop()
                if isinstance(n, fx.Node) and n.op == "call_function" and n not in seen:
                    seen.append(n)
                    stack.extend(n.all_input_nodes)
            _GRAPHS[s] = _Priced(tuple(reversed(seen)), infos)
    return {s: _GRAPHS[s] for s in samples if s in _GRAPHS}


def _adam_time(s: Sample, device: DeviceSpec) -> float:
    tensors = max(1, s.shape[0] // ADAM_TENSOR)
    nbytes = s.shape[0] // tensors * _dtype(s).itemsize
    return tensors * optimizer_step_time(nbytes, 2, device, "ADAM")


def predict(samples: Iterable[Sample], device: DeviceSpec) -> dict[Sample, float]:
    """Seconds the cost model prices each sample at on ``device`` (module docstring)."""
    samples = list(samples)
    graphs = _graphs(samples)
    return {s: _adam_time(s, device) if s.op.startswith("adam") else graphs[s].time(device) for s in samples}


# --------------------------------------------------------------------------------------------------
# the fit
# --------------------------------------------------------------------------------------------------


def round_sig(x: float, digits: int = SIGNIFICANT) -> float:
    """``x`` to ``digits`` significant digits (0 stays 0)."""
    return 0.0 if x == 0 else float(f"{x:.{digits - 1}e}")


@dataclass(frozen=True)
class Figures:
    """A device's fitted figures (module docstring), the fields of ``DeviceSpec`` they set."""

    kernel_launch_s: float
    memory_bandwidth: float
    matmul_dim_half: float
    matmul_overhead_s: float
    pointwise_s: tuple[tuple[str, float, float], ...]
    optimizer_param_s: tuple[tuple[str, float], ...]

    def apply(self, device: DeviceSpec) -> DeviceSpec:
        """``device`` with these figures (its other fields, the peaks among them, kept)."""
        return dataclasses.replace(
            device, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        )


def _lstsq(columns: Sequence[Sequence[float]], y: Sequence[float], t: Sequence[float]) -> list[float]:
    """Coefficients ``c`` of ``y ~ sum_j c_j x_j`` (columns ``x_j``) with the least squared error
    relative to the measured times ``t``: each row divided by its ``t``."""
    tt = torch.tensor(t, dtype=torch.float64)
    a = torch.tensor(columns, dtype=torch.float64).T / tt.unsqueeze(1)
    b = torch.tensor(y, dtype=torch.float64) / tt
    return [float(v) for v in torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1)]


def _rel_err(pred: Sequence[float], times: Sequence[float]) -> float:
    return sum((p / t - 1) ** 2 for p, t in zip(pred, times))


def _launch_and_bandwidth(graphs: Mapping[Sample, _Priced]) -> tuple[float, float]:
    rows = [(g.node[0].bytes, s.seconds) for s, g in graphs.items() if s.op in ELEMENTWISE]
    if len(rows) < 2:
        raise ReferenceDataError("fitting the launch and bandwidth needs two or more elementwise rows")
    times = [t for _, t in rows]
    launch, inv_bw = _lstsq([[1.0] * len(rows), [b for b, _ in rows]], times, times)
    return launch, 1.0 / inv_bw


def _gemm(g: _Priced) -> tuple[float, float]:
    """(F, d) of a matmul sample's node, as a plan counts them."""
    info, inputs = g.node
    return info.flops, float(gemm_min_dim(info.target, [tuple(a.meta["val"].shape) for a in inputs]))


def _matmul_fit(
    graphs: Mapping[Sample, _Priced], peaks: Mapping[str, float], launch: float, free_efficiency: bool
) -> tuple[float, float, dict[str, float]]:
    """(D, o, efficiency per dtype) of step 2 of the module docstring: the efficiency is
    ``EFF_MAX``, or with ``free_efficiency`` fitted per dtype too."""
    rows = [(s, *_gemm(g)) for s, g in graphs.items() if s.op == "mm" and s.dtype in peaks]
    if len(rows) < 3:
        raise ReferenceDataError("fitting the matmul figures needs three or more bf16 / fp32 mm rows")
    dtypes = sorted({s.dtype for s, _, _ in rows})
    times = [s.seconds for s, _, _ in rows]
    y = [t - launch for t in times]
    best: tuple[float, float, float, dict[str, float]] | None = None
    for half in DIM_HALF_GRID:
        # (F + peak T_HALF) / peak (d + D) / d: the seconds at efficiency 1
        x = [(f + peaks[s.dtype] * T_HALF) / peaks[s.dtype] * (d + half) / d for s, f, d in rows]
        if free_efficiency:  # a column per dtype (coefficient 1 / efficiency), then o
            cols = [[xi if s.dtype == dt else 0.0 for xi, (s, _, _) in zip(x, rows)] for dt in dtypes]
            *scale, overhead = _lstsq([*cols, [1.0] * len(rows)], y, times)
            if overhead < 0:  # a fixed cost is not negative
                scale, overhead = _lstsq(cols, y, times), 0.0
            eff = {dt: 1.0 / c for dt, c in zip(dtypes, scale)}
        else:
            (overhead,) = _lstsq([[1.0] * len(rows)], [yi - xi / EFF_MAX for yi, xi in zip(y, x)], times)
            overhead = max(overhead, 0.0)
            eff = dict.fromkeys(dtypes, EFF_MAX)
        pred = [launch + xi / eff[s.dtype] + overhead for xi, (s, _, _) in zip(x, rows)]
        err = _rel_err(pred, times)
        if best is None or err < best[0]:
            best = (err, float(half), overhead, eff)
    assert best is not None
    return best[1], best[2], best[3]


def efficiency(samples: Iterable[Sample], peaks: Mapping[str, float]) -> dict[str, float]:
    """The achievable fraction of ``peaks`` per dtype that the mm rows give when it is left free
    (with D and o fitted alongside): a check of ``compute.EFF_MAX`` on this device."""
    samples = list(samples)
    graphs = _graphs(samples)
    launch, _ = _launch_and_bandwidth(graphs)
    return _matmul_fit(graphs, peaks, round_sig(launch), free_efficiency=True)[2]


def _pointwise(
    samples: Sequence[Sample], graphs: Mapping[Sample, _Priced], device: DeviceSpec
) -> tuple[tuple[str, float, float], ...]:
    """``pointwise_s`` of step 3 of the module docstring: an entry per op of ``POINTWISE`` whose
    fitted figures are not both 0."""
    table = []
    for op, target in POINTWISE.items():
        large = [s for s in samples if s.op == op and _elements(graphs[s]) >= LARGE_ELEMENTS]
        figures = _op_figures(target, large, graphs, device)
        if any(figures):
            table.append((target, *figures))
    return tuple(sorted(table))


def _op_figures(
    target: str, rows: Sequence[Sample], graphs: Mapping[Sample, _Priced], device: DeviceSpec
) -> tuple[float, float]:
    """(forward, backward) seconds per element of op ``target`` from its ``rows``."""

    def priced(rows: Sequence[Sample], f: float, b: float) -> list[float]:
        dev = dataclasses.replace(device, pointwise_s=((target, f, b),) if f or b else ())
        return [graphs[s].time(dev) for s in rows]

    def best(candidates: Iterable[float], price: Callable[[float], list[float]], rows) -> float:
        # the candidate whose priced times have the least squared relative error (the smallest of ties)
        times = [s.seconds for s in rows]
        return min(sorted({max(c, 0.0) for c in candidates}), key=lambda p: _rel_err(price(p), times))

    fwd = [s for s in rows if not s.backward]
    both = [s for s in rows if s.backward]
    launch = device.kernel_launch_s
    if not fwd:
        return 0.0, 0.0
    p_fwd = round_sig(
        best(
            [0.0, *((s.seconds - launch) / _elements(graphs[s]) for s in fwd)],
            lambda p: priced(fwd, p, 0.0),
            fwd,
        )
    )
    if not both:
        return p_fwd, 0.0
    # the forward + backward time less the forward priced with p_fwd, less the backward's launch
    forward = dict(zip(both, priced(both, p_fwd, 0.0)))
    implied = [(s.seconds - forward[s] - launch) / _elements(graphs[s]) for s in both]
    return p_fwd, round_sig(best([0.0, *implied], lambda p: priced(both, p_fwd, p), both))


def _elements(g: _Priced) -> int:
    return node_elements(*g.node)


def _adam_param(samples: Sequence[Sample], device: DeviceSpec) -> float:
    rows = [s for s in samples if s.op == "adam_foreach"]
    if not rows:
        raise ReferenceDataError("fitting the Adam step needs adam_foreach rows")
    inplace, fresh, _ = OPTIMIZER_TRAFFIC["ADAM"]
    beyond = []
    for s in rows:
        tensors = max(1, s.shape[0] // ADAM_TENSOR)
        nbytes = s.shape[0] // tensors * _dtype(s).itemsize
        beyond.append(
            s.seconds / tensors - nbytes * (inplace / device.inplace_bw + fresh / device.memory_bandwidth)
        )
    return max(0.0, statistics.median(beyond))


def fit_figures(samples: Iterable[Sample], peaks: Mapping[str, float]) -> Figures:
    """The figures of the module docstring's fit, for a device of these dense ``peaks`` (FLOP/s
    per dtype name: the datasheet's; efficiency is what the fit accounts for)."""
    samples = list(samples)
    graphs = _graphs(samples)
    launch, bandwidth = _launch_and_bandwidth(graphs)
    launch, bandwidth = round_sig(launch), round_sig(bandwidth)
    half, overhead, _ = _matmul_fit(graphs, peaks, launch, free_efficiency=False)
    device = DeviceSpec(
        "fit", dict(peaks), 1, bandwidth, kernel_launch_s=launch,
        matmul_dim_half=half, matmul_overhead_s=round_sig(overhead), kind=DeviceKind.CUDA,
    )  # fmt: skip
    pointwise = _pointwise(samples, graphs, device)
    device = dataclasses.replace(device, pointwise_s=pointwise)
    adam = round_sig(_adam_param(samples, device))
    return Figures(launch, bandwidth, half, round_sig(overhead), pointwise, (("ADAM", adam),))


def errors(predicted: Mapping[Sample, float]) -> dict[str, list[tuple[Sample, float]]]:
    """Per family, each sample with its predicted / measured - 1."""
    out: dict[str, list[tuple[Sample, float]]] = {}
    for s, t in predicted.items():
        out.setdefault(s.family, []).append((s, t / s.seconds - 1))
    return out


def summary(errs: Sequence[float]) -> tuple[float, float]:
    """(median |error|, the error of largest magnitude) of relative errors."""
    return statistics.median(abs(e) for e in errs), max(errs, key=abs)


def describe(s: Sample) -> str:
    """``s``'s op (where its family has several) and shape as the sweep names them."""
    shape = " x ".join(str(v) for v in s.shape) if s.op == "mm" else str(list(s.shape))
    return f"{s.op} {shape}" if s.family == "elementwise" else shape
