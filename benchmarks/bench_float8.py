"""FP8 linears at published sizes: the search with FP8 allowed (auto) against FP8 off, priced alike.

    .venv/bin/python benchmarks/bench_float8.py [--size llama3-8b ...] [--time-limit S]

For each size, the model at its published shape on the meta device (``autopar.examples.llama``,
bf16), its global batch of sequences, the loss alone as output, planned by the search twice on the
same ``h100-sxm`` cluster: ``float8=off`` (every linear in bf16) and ``float8`` auto (each linear
FP8, tensorwise or rowwise, where the cost model prices it cheaper: ``autopar/lowerings/float8.py``).
Printed per plan: the mesh and trades, how many linears run FP8 and in which recipe, the predicted
step, the model's TFLOP/s per GPU (``6 N T + 12 L h s T`` FLOPs a step, ``N`` parameters, ``T``
tokens, attention's score and value GEMMs counted whole as Megatron counts them) and its MFU
against the bf16 dense peak (989 TFLOP/s), and FP8's predicted speedup.

Set beside the published figures in benchmarks/README.md: torchtitan's float8 on H100
(1.16-1.5x over bf16), Megatron's H100 FP8 runs (728-784 TFLOP/s per GPU).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

import autopar
from autopar import Float8, Outputs
from autopar.examples import llama

# name: (llama shape, global batch, sequence, GPUs)
SIZES = {
    "llama3-8b": (dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256), 8, 8192, 8),
    "llama3-70b": (dict(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256), 64, 8192, 64),
}
BF16_PEAK = 989e12


def step_flops(model, shape: dict, batch: int, seq: int) -> float:
    params = sum(p.numel() for p in model.parameters())
    tokens = batch * seq
    return 6 * params * tokens + 12 * shape["layers"] * shape["hidden"] * seq * tokens


def run(name: str, time_limit: float | None) -> list[str]:
    shape, batch, seq, gpus = SIZES[name]
    with torch.device("meta"):
        model, inputs = llama(**shape, batch=batch, seq=seq)
    cluster = autopar.ClusterSpec.preset("h100-sxm", nodes=max(1, gpus // 8), devices_per_node=min(gpus, 8))
    flops = step_flops(model, shape, batch, seq)
    rows, steps = [], {}
    for f8 in (Float8.OFF, None):
        t0 = time.perf_counter()
        plan = autopar.plan(model, cluster, inputs, outputs=Outputs.LOSS, float8=f8, time_limit_s=time_limit)
        took = time.perf_counter() - t0
        step = plan.predicted.step_time_s
        steps[f8] = step
        tf = flops / step / gpus
        recipes = {}
        for r in plan.float8_linears.values():
            recipes[r.value] = recipes.get(r.value, 0) + 1
        linears = sum(1 for d in plan.decisions if d.op == "aten.linear.default")
        fp8 = ", ".join(f"{n} {r}" for r, n in recipes.items()) or "none"
        rows.append(
            f"| {name} | {gpus} | {'auto' if f8 is None else 'off'} | {tuple(plan.mesh_shape)}, "
            f"{plan.pipeline.describe()}, {plan.trades.describe()} | {fp8} of {linears} | {step:.3f} s | "
            f"{tf / 1e12:.0f} | {tf / BF16_PEAK:.1%} | {took:.0f} s |"
        )
    rows.append(f"| {name} | {gpus} | speedup | | | {steps[Float8.OFF] / steps[None]:.3f}x | | | |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", nargs="*", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--time-limit", type=float, default=None, help="the ILP's time limit per mesh (s)")
    args = ap.parse_args()
    print(
        f"# {platform.node()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print(
        "| size | GPUs | FP8 | mesh, pipeline, trades | FP8 linears | step | TFLOP/s per GPU | MFU (bf16 peak) | planning |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.size:
        for row in run(name, args.time_limit):
            print(row, flush=True)


if __name__ == "__main__":
    main()
