"""Each fused kernel (``kernels/``) against the eager pattern it replaces and against
``torch.compile`` of that pattern: forward and forward + backward seconds, and for the fused
cross-entropy the peak memory of forward + backward.

Shapes: Llama-3-8B (8192 tokens as 2 x 4096, hidden 4096, FFN 14336, 32 query and 8 K/V heads of
128, vocabulary 128256) and GPT-2 (8 x 1024 tokens, hidden 768, 12 heads of 64, FFN 3072,
vocabulary 50257), bf16. The eager patterns are Hugging Face's (LlamaRMSNorm after the residual
add, ``silu(gate) * up``, ``apply_rotary_pos_emb``, ``cross_entropy(logits.float())``).

    python benchmarks/bench_kernels.py [--out results.json]        # on a CUDA machine
    python benchmarks/bench_kernels.py --device cpu --small         # smoke run of the script

Times: CUDA events after warm-up, median of ``--repeats`` of 10 back-to-back calls (host dispatch
included where it is longer than the kernels), and ``*_device_*``: the same work captured in a CUDA
graph and replayed (the device alone: what a step whose host runs ahead sees); peak memory:
``torch.cuda.max_memory_allocated`` above what the inputs hold, over one forward + backward.
On CPU (``--small``) the fused ops run their torch fallbacks: the figures say nothing there.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from autopar.kernels import ops

ops.load()
A = torch.ops.autopar

SHAPES = {
    "llama3-8b": dict(
        batch=2, seq=4096, hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256
    ),
    "gpt2": dict(batch=8, seq=1024, hidden=768, ffn=3072, heads=12, kv_heads=12, head_dim=64, vocab=50257),
}
SMALL = dict(batch=2, seq=64, hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16, vocab=500)


# -- the eager patterns ------------------------------------------------------------------------------


def eager_add_rms_norm(x, r, w, eps=1e-5):
    h = x + r
    hf = h.float()
    return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype), h


def fused_add_rms_norm(x, r, w, eps=1e-5):
    return A.rms_norm(x, r, w, eps, 0.0)


def eager_add_layer_norm(x, r, w, b, eps=1e-5):
    h = x + r
    return F.layer_norm(h, (h.shape[-1],), w, b, eps), h


def fused_add_layer_norm(x, r, w, b, eps=1e-5):
    return A.layer_norm(x, r, w, b, eps)


def eager_swiglu(g, u):
    return F.silu(g) * u


def fused_swiglu(g, u):
    return A.swiglu(g, u)


def eager_geglu(g, u):
    return F.gelu(g, approximate="tanh") * u


def fused_geglu(g, u):
    return A.geglu(g, u, "tanh")


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def eager_rope(q, k, cos, sin):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def fused_rope(q, k, cos, sin):
    return A.rope(q, cos, sin), A.rope(k, cos, sin)


def eager_cross_entropy(h, w, labels):
    return F.cross_entropy((h @ w.T).float(), labels)


def fused_cross_entropy(h, w, labels):
    out = A.linear_cross_entropy(h, w, labels, -100, "mean", 0)
    return out[0] if isinstance(out, tuple) else out  # (loss, per-row logsumexp)


# -- inputs ------------------------------------------------------------------------------------------


def inputs(kernel: str, s: dict, device, dtype):
    t = s["batch"] * s["seq"]

    def rnd(*shape, grad=True):
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)

    if kernel == "rms_norm":
        return (
            rnd(s["batch"], s["seq"], s["hidden"]),
            rnd(s["batch"], s["seq"], s["hidden"]),
            rnd(s["hidden"]),
        )
    if kernel == "layer_norm":
        h = s["hidden"]
        return rnd(s["batch"], s["seq"], h), rnd(s["batch"], s["seq"], h), rnd(h), rnd(h)
    if kernel in ("swiglu", "geglu"):
        return rnd(s["batch"], s["seq"], s["ffn"]), rnd(s["batch"], s["seq"], s["ffn"])
    if kernel == "rope":
        b, n, d = s["batch"], s["seq"], s["head_dim"]
        # q and k as the model has them: a transpose of the projection's [B, S, heads, D]
        q = rnd(b, n, s["heads"], d, grad=False).transpose(1, 2).requires_grad_()
        k = rnd(b, n, s["kv_heads"], d, grad=False).transpose(1, 2).requires_grad_()
        pos = torch.arange(n, device=device, dtype=torch.float32)
        inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
        ang = torch.cat([torch.outer(pos, inv)] * 2, dim=-1)
        cos = ang.cos()[None, None].expand(b, 1, n, d).to(dtype)
        sin = ang.sin()[None, None].expand(b, 1, n, d).to(dtype)
        return q, k, cos, sin
    if kernel == "cross_entropy":
        h = rnd(t, s["hidden"])
        w = (torch.randn(s["vocab"], s["hidden"], device=device, dtype=dtype) * 0.02).requires_grad_()
        labels = torch.randint(0, s["vocab"], (t,), device=device)
        return h, w, labels
    raise ValueError(kernel)


KERNELS = {
    "rms_norm": (eager_add_rms_norm, fused_add_rms_norm),
    "layer_norm": (eager_add_layer_norm, fused_add_layer_norm),
    "swiglu": (eager_swiglu, fused_swiglu),
    "geglu": (eager_geglu, fused_geglu),
    "rope": (eager_rope, fused_rope),
    "cross_entropy": (eager_cross_entropy, fused_cross_entropy),
}


# -- timing ------------------------------------------------------------------------------------------


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


INNER = 10  # calls per timing, back to back: the host runs ahead of the GPU as in a model's step


def _timed(fn, device, repeats: int) -> float:
    """Seconds per call: the median over ``repeats`` of ``INNER`` calls in a row, timed with CUDA
    events. One call alone would add the host's dispatch to the GPU's time (the GPU waits for the
    launch); in a training step the host queues kernels ahead, so a call costs the GPU's time, or
    the host's where that is longer: what back-to-back calls measure."""
    for _ in range(3):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(INNER):
                fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / INNER)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _outputs(out):
    return [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]


def _fwd_bwd(fn, args):
    def run():
        outs = _outputs(fn(*args))
        grads = [torch.ones_like(o) for o in outs]
        torch.autograd.backward(outs, grads)
        for a in args:
            if isinstance(a, torch.Tensor) and a.grad is not None:
                a.grad = None

    return run


def _forward(fn, args):
    def run():
        with torch.no_grad():
            fn(*args)

    return run


def _graphed(fn, device):
    """``fn`` captured in a CUDA graph, its replay: what the device alone spends (no host
    dispatch, no kernel launch from Python), the time a step whose host runs ahead sees."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up (allocator, Triton's compilation) outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def peak_bytes(fn, args, device) -> int | None:
    """Peak bytes allocated above what is held before, over one forward + backward."""
    if device.type != "cuda":
        return None
    _fwd_bwd(fn, args)()  # warm (allocator, autotuning)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _fwd_bwd(fn, args)()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench(kernel: str, shape: str, s: dict, device, dtype, repeats: int, compile_: bool) -> dict:
    eager, fused = KERNELS[kernel]
    args = inputs(kernel, s, device, dtype)
    row: dict = {"kernel": kernel, "shape": shape}
    fns = {"eager": eager, "fused": fused}
    if compile_:
        fns["compiled"] = torch.compile(eager)
    for name, fn in fns.items():
        try:
            row[f"{name}_fwd_ms"] = _timed(_forward(fn, args), device, repeats) * 1e3
            row[f"{name}_fwdbwd_ms"] = _timed(_fwd_bwd(fn, args), device, repeats) * 1e3
            if kernel == "cross_entropy":
                row[f"{name}_peak_mib"] = (peak_bytes(fn, args, device) or 0) / 2**20
            elif device.type == "cuda" and name != "compiled":
                for part, make in (("fwd", _forward), ("fwdbwd", _fwd_bwd)):
                    replay = _graphed(make(fn, args), device)
                    row[f"{name}_device_{part}_ms"] = _timed(replay, device, repeats) * 1e3
        except Exception as e:  # noqa: BLE001 - one failing variant is reported, the others still run
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    for part in ("fwd", "fwdbwd", "device_fwd", "device_fwdbwd"):
        e, f = row.get(f"eager_{part}_ms"), row.get(f"fused_{part}_ms")
        if e and f:
            row[f"speedup_{part}"] = e / f
        c = row.get(f"compiled_{part}_ms")
        if c and f:
            row[f"vs_compiled_{part}"] = c / f
    if row.get("fused_peak_mib"):
        row["peak_ratio"] = row["eager_peak_mib"] / row["fused_peak_mib"]
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a smoke run of the script)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    shapes = {"small": SMALL} if a.small else SHAPES
    rows = []
    for shape, s in shapes.items():
        for kernel in a.kernels.split(","):
            row = bench(kernel, shape, s, device, torch.bfloat16, a.repeats, not a.no_compile)
            rows.append(row)
            print(
                json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )
            if a.out:  # kept row by row: a run cut short still leaves what it measured
                with open(a.out, "w") as f:
                    json.dump({"rows": rows}, f, indent=1)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    print(json.dumps(meta))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
