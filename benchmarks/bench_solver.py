"""Planning time = trace on the meta device + strategies + costs + ILP, at three model sizes.

    .venv/bin/python benchmarks/bench_solver.py [--case NAME ...] [--outputs full|local]

Cases: gpt2-small on 8 devices; LLaMA-3-8B shape on 64 (8 nodes x 8 H100); LLaMA-70B shape on
1024; and the scaling of one width with 12, 24, 48 and 96 layers. Figures, with the machine they
were measured on, are recorded in benchmarks/README.md. ``--outputs local`` plans modules that
return outputs as each rank's piece (``autopar.Outputs.LOCAL``): a training loop needs only the
loss, and gathering 64 x 4096 x 128256 logits on every rank does not fit an 80 GB device.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

import autopar
from autopar.examples import llama


def _llama(layers, hidden, ffn, heads, kv_heads, vocab=128256):
    with torch.device("meta"):  # seq=8192: the config's max_position_embeddings; `run` makes the inputs
        model, _ = llama(layers=layers, hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv_heads, vocab=vocab,
                         batch=1, seq=8192)  # fmt: skip
    return model


def _gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        return GPT2LMHeadModel(GPT2Config(use_cache=False)).to(torch.bfloat16)


OUTPUTS = {"outputs": autopar.Outputs.FULL}


def run(name, model, batch, seq, vocab, cluster, **kw):
    kw = {**OUTPUTS, **kw}
    ids = torch.randint(0, vocab, (batch, seq))
    lines: list[str] = []
    t0 = time.perf_counter()
    try:
        plan = autopar.plan(model, cluster, {"input_ids": ids, "labels": ids}, progress=lines.append, **kw)
    except autopar.NoPlanFitsError as e:  # report it and go on with the other cases
        print(
            f"{name:34s} {cluster.world_size:5d} dev  plan {time.perf_counter() - t0:6.1f} s  {e}", flush=True
        )
        for line in lines:
            print("    " + line)
        return None
    dt = time.perf_counter() - t0
    p = plan.predicted
    print(
        f"{name:34s} {cluster.world_size:5d} dev  plan {dt:6.1f} s  mesh {str(plan.mesh_shape):12s} "
        f"step {p.step_time_s * 1e3:10.1f} ms  mem {p.peak_memory_bytes / 2**30:7.1f} GiB  "
        f"optimality gap {plan.solver.gap:.1%} ({plan.solver.status})",
        flush=True,
    )
    for line in lines:
        print("    " + line)
    return dt


CASES = {
    "gpt2-small-8": lambda: run("gpt2-small (12L, 768)", _gpt2_small(), 32, 1024, 50257,
                                autopar.ClusterSpec.preset("h100-sxm")),
    "llama3-8b-64": lambda: run("llama-3-8b shape (32L, 4096)", _llama(32, 4096, 14336, 32, 8), 64, 4096, 128256,
                                autopar.ClusterSpec.preset("h100-sxm", nodes=8)),
    "llama-70b-1024": lambda: run("llama-70b shape (80L, 8192)", _llama(80, 8192, 28672, 64, 8), 128, 4096, 128256,
                                  autopar.ClusterSpec.preset("h100-sxm", nodes=128)),
    "depth": lambda: [
        run(f"llama 2048-wide, {n} layers", _llama(n, 2048, 5632, 16, 4, 32000), 16, 2048, 32000,
            autopar.ClusterSpec.preset("h100-sxm"), mesh_shape=(2, 4), memory_limit_bytes=float("inf"))
        for n in (12, 24, 48, 96)
    ],
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", choices=list(CASES), help="run only these (repeatable)")
    ap.add_argument("--outputs", choices=[o.value for o in autopar.Outputs], default="full")
    args = ap.parse_args()
    OUTPUTS["outputs"] = autopar.Outputs(args.outputs)
    print(f"# {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    for name in args.case or list(CASES):
        CASES[name]()


if __name__ == "__main__":
    main()
