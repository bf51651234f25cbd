"""Eager PyTorch against the module autopar generates, on one device: step time, peak memory, and
what the plan predicted for both.

One process, world 1 (NCCL on a GPU, gloo on the CPU): for each model (``--models``: GPT-2,
Llama, the PaLM-style model, in bf16 at ``--size``), the same training step twice, Adam (fused
on CUDA) with bf16 mixed precision, fp32 master weights (what autopar plans for a bf16 model,
``Precision.BF16``; eager runs the fp32 model under ``torch.autocast`` to match):

* ``eager``: ``loss = model(**batch).loss; loss.backward(); opt.step(); opt.zero_grad()``;
* ``autopar``: ``pmodel = autoparallelize(model, ClusterSpec.local(), batch)``, then
  ``pmodel.step(**batch)`` and the same optimizer calls (the plan's own, on this machine's preset).

Step time: the median of ``--steps`` steps after ``--warmup`` (CUDA: ``torch.cuda.synchronize`` at
each step's end); peak memory: ``torch.cuda.max_memory_allocated`` over the timed steps (CPU: the
live tensors' peak, ``LiveTensorTracker``). Also ``autopar/eager - 1`` and the plan's predicted
step and peak against the measured ones.

    python benchmarks/bench_gpu.py [--models gpt2,llama,palm] [--size small|medium] [--steps 20] [--profile F]

On a machine without a GPU it runs on the CPU (``--size small`` is the default there): a check
that it runs, not GPU figures. Record GPU results in benchmarks/README.md with the card and the
torch version this prints.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import autopar
from autopar.launch import free_port
from autopar.tools.measure import LiveTensorTracker

SIZES = {  # (layers, hidden, heads, batch, seq, vocab)
    "small": (2, 256, 4, 4, 128, 4096),
    "medium": (24, 1024, 16, 8, 1024, 50304),  # GPT-2 medium's shape
}


def _models(size: str):
    layers, hidden, heads, batch, seq, vocab = SIZES[size]
    from autopar import examples
    from autopar.models.palm import PalmLM

    def gpt2():
        return examples.gpt(layers=layers, hidden=hidden, heads=heads, vocab=vocab, batch=batch, seq=seq)

    def llama():
        return examples.llama(
            layers=layers, hidden=hidden, ffn=int(hidden * 8 / 3) // 64 * 64, heads=heads, kv_heads=max(heads // 4, 1),
            vocab=vocab, batch=batch, seq=seq,
        )  # fmt: skip

    def palm():
        torch.manual_seed(0)
        model = PalmLM(vocab=vocab, hidden=hidden, layers=layers, heads=heads, max_seq=seq).to(torch.bfloat16)
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
        return model, {"input_ids": ids, "labels": ids}

    return {"gpt2": gpt2, "llama": llama, "palm": palm}


def init_world_one() -> tuple[torch.device, str]:
    """A process group of one rank (NCCL on the first GPU, gloo on the CPU): (device, card name)."""
    cuda = torch.cuda.is_available()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    store = tempfile.mktemp(prefix="bench_gpu_")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    return (torch.device("cuda", 0), torch.cuda.get_device_name(0)) if cuda else (torch.device("cpu"), "cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _measure(step, device: torch.device, warmup: int, steps: int) -> tuple[float, int]:
    """(median step seconds, peak bytes over the timed steps) of ``step()``."""
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times), torch.cuda.max_memory_allocated()
    with LiveTensorTracker() as tracker:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), tracker.peak


def _profile(step, device: torch.device, path: str | None, title: str) -> None:
    """Append the ops of three steps of ``step()`` to ``path``, most device time first."""
    if not path:
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(3):
            step()
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    with open(path, "a") as f:
        f.write(f"== {title} (3 steps)\n{prof.key_averages().table(sort_by=key, row_limit=30)}\n")


def _eager(build, device, args):
    model, batch = build()
    model = model.float().to(device)  # fp32 masters, bf16 compute: what the plan runs
    batch = {k: v.to(device) for k, v in batch.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    result = _measure(step, device, args.warmup, args.steps)
    _profile(step, device, args.profile, f"{args.current} eager")
    return result


def _autopar(build, device, args):
    model, batch = build()
    pmodel = autopar.autoparallelize(model, autopar.ClusterSpec.local(), batch)
    opt = pmodel.optimizer(torch.optim.AdamW, lr=1e-4, fused=device.type == "cuda")

    def step():
        pmodel.step(**batch)
        opt.step()
        opt.zero_grad()

    t, peak = _measure(step, device, args.warmup, args.steps)
    _profile(step, device, args.profile, f"{args.current} autopar")
    return t, peak, pmodel.plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2,llama,palm")
    ap.add_argument("--size", default=None, choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--profile", default=None, help="append each run's op table (torch.profiler) to this file"
    )
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    args.size = args.size or ("medium" if cuda else "small")
    device, card = init_world_one()
    print(
        f"{card}, torch {torch.__version__}, size {args.size} {SIZES[args.size]}, bf16 mixed precision, world 1"
    )
    print(
        f"{'model':<6} {'eager ms':>9} {'autopar ms':>11} {'overhead':>9} {'predicted ms':>13} "
        f"{'eager MiB':>10} {'autopar MiB':>12} {'predicted MiB':>14}"
    )
    builds = _models(args.size)
    mib = 2**20
    for name in args.models.split(","):
        args.current = name
        e_t, e_mem = _eager(builds[name], device, args)
        a_t, a_mem, plan = _autopar(builds[name], device, args)
        p = plan.predicted
        print(
            f"{name:<6} {e_t * 1e3:>9.2f} {a_t * 1e3:>11.2f} {a_t / e_t - 1:>+9.1%} {p.step_time_s * 1e3:>13.2f} "
            f"{e_mem / mib:>10.1f} {a_mem / mib:>12.1f} {p.peak_memory_bytes / mib:>14.1f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
