"""The memory-for-time trades on one device, run for real: does each free the memory its plan says,
at the time it says, with the same losses?

One process, world 1 (NCCL on a GPU, gloo on the CPU), one bf16 Llama (``--size``, as
``bench_gpu.py``), planned on a mesh of one data-parallel device with each trade forced (``--trades``):

* ``none``: nothing traded (the reference row);
* ``selective``, ``full``: activation recomputation (``torch.utils.checkpoint`` in the generated module);
* ``micro2``, ``micro4``: the batch in 2 or 4 micro-batches (``pmodel.step``);
* ``zero3``: FSDP2 over the one device (parameters gathered per block: on one device it frees
  nothing, it shows what the machinery costs);
* ``offload``: ZeRO-2 with the fp32 masters, gradients and Adam state in (pinned) host memory,
  FSDP2's ``CPUOffloadPolicy``, the optimizer step on the host;
* ``offload3``: parameter offload (``Offload.PARAMETERS``): the same with ZeRO-3, the device
  holding only the blocks in flight, each block's shards copied up one block ahead.

For each: the median step time and the device's peak memory (``torch.cuda.max_memory_allocated``
over the timed steps; on the CPU the live tensors' peak), next to the plan's prediction; the
peak's saving against ``none``, measured and predicted; the losses of the first ``--check`` steps
against ``none``'s (same data, bf16 compute: equal within bf16 rounding); and where the
optimizer's state lives (device, pinned). Adam, bf16 mixed precision (fp32 masters).

    python benchmarks/bench_gpu_trades.py [--size small|medium] [--trades none,full,...] [--steps 10]

Without a GPU it runs on the CPU (``--size small``): a check that every trade runs, not the
device-memory figures. Record GPU results in benchmarks/README.md with the card and the torch
version this prints.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import autopar
from autopar import AxisRole, Offload, Recompute
from autopar.tools.measure import LiveTensorTracker

sys.path.insert(0, os.path.dirname(__file__))
from bench_gpu import SIZES, _models, _sync, init_world_one  # noqa: E402  (the same models and sizes)

TRADES = {
    "none": dict(recompute=Recompute.NONE, micro_batches=1, zero_stage=0, offload=Offload.NONE),
    "selective": dict(recompute=Recompute.SELECTIVE, micro_batches=1, zero_stage=0, offload=Offload.NONE),
    "full": dict(recompute=Recompute.FULL, micro_batches=1, zero_stage=0, offload=Offload.NONE),
    "micro2": dict(recompute=Recompute.NONE, micro_batches=2, zero_stage=0, offload=Offload.NONE),
    "micro4": dict(recompute=Recompute.NONE, micro_batches=4, zero_stage=0, offload=Offload.NONE),
    "zero3": dict(recompute=Recompute.NONE, micro_batches=1, zero_stage=3, offload=Offload.NONE),
    "offload": dict(recompute=Recompute.NONE, micro_batches=1, zero_stage=2, offload=Offload.OPTIMIZER),
    "offload3": dict(recompute=Recompute.NONE, micro_batches=1, zero_stage=3, offload=Offload.PARAMETERS),
}


def _state_home(opt) -> str:
    """Where the optimizer's state tensors live: 'device[, pinned]', by bytes held."""
    homes: dict[str, int] = {}
    for state in opt.state.values():
        for v in state.values():
            if not isinstance(v, torch.Tensor) or v.dim() == 0:
                continue
            local = v.to_local() if hasattr(v, "to_local") else v
            key = local.device.type + (", pinned" if local.device.type == "cpu" and local.is_pinned() else "")
            homes[key] = homes.get(key, 0) + local.numel() * local.element_size()
    return (
        " + ".join(f"{k} {b / 2**20:.0f} MiB" for k, b in sorted(homes.items(), key=lambda kv: -kv[1])) or "-"
    )


def _run(name, build, device, args):
    """(median step s, peak bytes, losses of the first --check steps, state home, plan, and on CUDA
    (bytes between steps, bytes a forward keeps or None), else None)."""
    model, batch = build()
    kw = TRADES[name]
    pmodel = autopar.autoparallelize(
        model, autopar.ClusterSpec.local(), batch, mesh_shape=(1,), axis_roles=(AxisRole.DATA,), **kw
    )
    del model
    opt = pmodel.optimizer(torch.optim.AdamW, lr=1e-4, fused=device.type == "cuda")
    losses: list[float] = []

    def step():
        loss = pmodel.step(**batch)  # forward and backward, the micro-batches' mean loss
        opt.step()
        opt.zero_grad()
        return loss

    for _ in range(args.check):  # the first steps: the losses, and warm-up
        losses.append(float(step()))
    _sync(device)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated()
        at_rest = torch.cuda.memory_allocated()  # between steps: what the step keeps
        if kw["zero_stage"] == 0 and kw["micro_batches"] == 1:  # a forward alone (FSDP2 wants its backward)
            out = pmodel(**batch)
            _sync(device)
            kept = torch.cuda.memory_allocated() - at_rest  # what forward keeps for backward, and the outputs
            del out
        else:
            kept = None
        rest = (at_rest, kept)
    else:
        with LiveTensorTracker() as tracker:
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
        peak = tracker.peak
        rest = None
    return statistics.median(times), peak, losses, _state_home(opt), pmodel.plan, rest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama", choices=["gpt2", "llama", "palm"])
    ap.add_argument("--size", default=None, choices=sorted(SIZES))
    ap.add_argument("--trades", default=",".join(TRADES))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--check", type=int, default=3, help="steps whose losses are compared (also the warm-up)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    args.size = args.size or ("medium" if cuda else "small")
    device, card = init_world_one()
    print(
        f"{card}, torch {torch.__version__}, {args.model} {args.size} {SIZES[args.size]}, bf16, Adam, world 1"
    )
    print(
        f"{'trade':<9} {'ms':>8} {'pred ms':>8} {'MiB':>8} {'pred MiB':>9} {'saved MiB':>10} {'pred saved':>11} "
        f"{'max |dloss|':>12}  optimizer state"
    )
    build = _models(args.size)[args.model]
    mib = 2**20
    ref = None
    for name in args.trades.split(","):
        try:
            t, peak, losses, home, plan, rest = _run(name, build, device, args)
        except Exception as e:  # one trade's failure is a row, not the end of the run
            print(f"{name:<9} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        finally:  # the last run's module and optimizer state are gone before the next is built
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        p = plan.predicted
        if ref is None and name == "none":
            ref = (peak, p.peak_memory_bytes, losses)
        saved = (
            f"{(ref[0] - peak) / mib:>10.1f} {(ref[1] - p.peak_memory_bytes) / mib:>11.1f}"
            if ref
            else f"{'-':>10} {'-':>11}"
        )
        dloss = max(abs(a - b) for a, b in zip(losses, ref[2])) if ref else float("nan")
        print(
            f"{name:<9} {t * 1e3:>8.2f} {p.step_time_s * 1e3:>8.2f} {peak / mib:>8.1f} {p.peak_memory_bytes / mib:>9.1f} "
            f"{saved} {dloss:>12.2e}  {home}",
            flush=True,
        )
        print(
            f"          plan: {plan.trades.describe()}; losses {', '.join(f'{x:.4f}' for x in losses)}",
            flush=True,
        )
        if rest is not None:  # measured (CUDA) against the plan's parts
            at_rest, kept = rest
            print(
                f"          MiB between steps {at_rest / mib:.1f} (predicted parameters + optimizer "
                f"{(p.param_bytes + p.optimizer_bytes) / mib:.1f}); kept by a forward "
                + (f"{kept / mib:.1f}" if kept is not None else "-")
                + f" (predicted activations {p.activation_bytes / mib:.1f}, gradients {p.grad_bytes / mib:.1f})",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
