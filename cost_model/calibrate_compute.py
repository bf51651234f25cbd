"""Measure one device's compute figures for ``cost_model/compute.py`` (``autopar calibrate``).

Run on one rank while the others wait (``cost_model/calibrate.py``), with the thread count the
ranks use, so the figures are one rank's own:

* per-op overhead ``launch`` [s]: a chain of 60 tiny ops (mul, add, tanh on 8 elements) run
  forward and backward through autograd, as a training step runs them; the cost model charges
  each op ``launch`` once forward and once backward, so ``launch = t_chain / (60 * 2)``;
* memory bandwidth ``mem_bw`` [B/s]: ``torch.add(a, b, out=c)`` on float32 tensors larger than
  any cache moves ``M = 3 * nbytes`` (2 reads, 1 write): ``mem_bw = M / (t - t_1)``, with ``t_1``
  the same call on one element (its dispatch: no autograd here, unlike ``launch``);
* FLOP/s: ``torch.nn.functional.linear`` of square fp32 operands of a few sizes ``s``, forward
  and backward (gradients of input and weight) as a training step runs it, ``F = 3 * 2 s^3``
  FLOPs (a forward and two backward matmuls, each writing a fresh output); a least-squares line
  ``t = F / rate + c`` gives the effective rate ``rate`` [FLOP/s] (on this project's VM 90-95
  GFLOP/s where a forward ``mm`` alone reaches 104). The roofline prices a large GEMM at
  ``F / (peak * EFF_MAX)``, so the peak stored is ``rate / EFF_MAX``: the cost model then
  predicts the measured large-GEMM rate;
* pointwise table ``pointwise_s`` [s per element of the op's largest tensor]: each op of
  ``POINTWISE_OPS`` on ``POINTWISE_NUMEL`` float32 elements (rows of 256 for the ops that reduce
  a last dim: softmax, layer_norm, cross-entropy over 256 classes), forward
  (``t_f``) and forward + backward (``t_fb``) through autograd:
  ``p_fwd = (t_f - launch) / E``, ``p_bwd = (t_fb - t_f - launch) / E``. The size is the activations'
  of the models this project runs on CPU (``cost_model/compute.py`` takes the larger of these
  figures and the roofline).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from autopar.cost_model.compute import EFF_MAX

aten = torch.ops.aten

LAUNCH_CHAIN_OPS = 60
POINTWISE_NUMEL = 2**18
ROW = 256  # last dim of the ops that normalize over it (softmax, layer_norm)


def _row(f: Callable) -> Callable:
    return lambda x: f(x.view(-1, ROW))


# op name (str of the aten overload, as NodeInfo.target holds it) -> how to call it on a float tensor
POINTWISE_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "aten.tanh.default": aten.tanh.default,
    "aten.exp.default": aten.exp.default,
    "aten.log.default": aten.log.default,
    "aten.sigmoid.default": aten.sigmoid.default,
    "aten.silu.default": aten.silu.default,
    "aten.gelu.default": aten.gelu.default,
    "aten.erf.default": aten.erf.default,
    "aten.sin.default": aten.sin.default,
    "aten.cos.default": aten.cos.default,
    "aten.rsqrt.default": aten.rsqrt.default,
    "aten.sqrt.default": aten.sqrt.default,
    "aten.softmax.int": _row(lambda x: aten.softmax.int(x, -1)),
    "aten.log_softmax.int": _row(lambda x: aten.log_softmax.int(x, -1)),
    "aten.layer_norm.default": _row(lambda x: aten.layer_norm.default(x, [ROW])),
    "aten.cross_entropy_loss.default": _row(
        lambda x: aten.cross_entropy_loss.default(
            x, torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        )
    ),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], device: torch.device, repeats: int, inner: int = 1) -> float:
    """Median seconds of one ``fn()`` over ``repeats`` samples of ``inner`` calls, after one call."""
    fn()
    sync(device)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        ts.append((time.perf_counter() - t0) / inner)
    return statistics.median(ts)


def _inner_for(fn: Callable[[], object], device: torch.device, target_s: float = 2e-3) -> int:
    """Calls per sample so that one sample lasts about ``target_s`` (timer resolution, noise)."""
    t0 = time.perf_counter()
    fn()
    sync(device)
    return max(1, min(1000, int(target_s / max(time.perf_counter() - t0, 1e-7))))


def measure_launch(device: torch.device, repeats: int, inner: int) -> float:
    x0 = torch.ones(8, device=device, requires_grad=True)
    c = torch.full((8,), 0.999, device=device)

    def chain():
        y = x0
        for i in range(LAUNCH_CHAIN_OPS // 3):
            y = torch.tanh(torch.mul(y, c) + i)
        y.sum().backward()

    return median_time(chain, device, repeats, inner) / (LAUNCH_CHAIN_OPS * 2)


def _add_time(numel: int, device: torch.device, repeats: int) -> float:
    bufs = [torch.ones(numel, device=device) for _ in range(3)]

    def add():
        torch.add(bufs[0], bufs[1], out=bufs[2])

    return median_time(add, device, repeats, _inner_for(add, device))


def _add_bandwidth(numel: int, device: torch.device, repeats: int, overhead: float) -> float:
    """B/s of an ``add`` of ``numel`` float32 elements, less ``overhead`` (the same call on one
    element: dispatch without autograd, unlike ``launch``)."""
    return 3 * numel * 4 / max(_add_time(numel, device, repeats) - overhead, 1e-9)


def measure_pointwise(device: torch.device, repeats: int, launch: float) -> dict[str, list[float]]:
    """``{op: [forward, backward] seconds per input element]}`` for ``POINTWISE_OPS``."""
    out: dict[str, list[float]] = {}
    x = (torch.rand(POINTWISE_NUMEL, device=device) + 0.5).requires_grad_(True)
    for name, op in POINTWISE_OPS.items():
        y = op(x)
        g = torch.ones_like(y)

        def fwd(op=op):
            op(x)

        def fwd_bwd(op=op, g=g):
            torch.autograd.backward(op(x), g)

        t_f = median_time(fwd, device, repeats, _inner_for(fwd, device))
        t_fb = median_time(fwd_bwd, device, repeats, _inner_for(fwd_bwd, device))
        x.grad = None
        n = x.numel()
        out[name] = [max(t_f - launch, 0.0) / n, max(t_fb - t_f - launch, 0.0) / n]
    return out


def measure_compute(device: torch.device | str = "cpu", quick: bool = False) -> dict:
    """Every compute figure of the module docstring, for ``device``.

    Returns ``{"peak_flops": rate / EFF_MAX, "flops_effective": rate, "memory_bandwidth": ...,
    "kernel_launch_s": ..., "pointwise_s": {op: [fwd, bwd]}, "matmul": [(size, flops, seconds), ...],
    "matmul_intercept_s": ...}``; the keys named as DeviceSpec fields are those fields.
    """
    dev = torch.device(device)
    repeats = 3 if quick else 7
    launch = measure_launch(dev, repeats, inner=5 if quick else 20)
    dispatch = _add_time(1, dev, repeats)
    mem_bw = _add_bandwidth((4 if quick else 16) * 2**20, dev, repeats, dispatch)  # 16 / 64 MiB per tensor
    points = []
    for s in (96, 192, 288) if quick else (128, 256, 384, 512):
        x = torch.randn(s, s, device=dev, requires_grad=True)
        w = torch.randn(s, s, device=dev, requires_grad=True)
        g = torch.randn(s, s, device=dev)

        def train(x=x, w=w, g=g):
            torch.nn.functional.linear(x, w).backward(g)
            x.grad = w.grad = None

        points.append((s, 3 * 2.0 * s**3, median_time(train, dev, repeats)))
    fl = torch.tensor([p[1] for p in points], dtype=torch.float64)
    ts = torch.tensor([p[2] for p in points], dtype=torch.float64)
    design = torch.stack([fl, torch.ones_like(fl)], dim=1)
    slope, intercept = (float(v) for v in torch.linalg.lstsq(design, ts.unsqueeze(1)).solution.squeeze(1))
    if not slope > 0:  # degenerate fit (noise): use the largest matmul's rate
        slope, intercept = float(ts[-1] / fl[-1]), 0.0
    rate = 1.0 / float(slope)
    return {
        "peak_flops": rate / EFF_MAX,
        "flops_effective": rate,
        "memory_bandwidth": mem_bw,
        "kernel_launch_s": launch,
        "pointwise_s": measure_pointwise(dev, repeats, launch),
        "matmul": points,
        "matmul_intercept_s": float(intercept),
    }
