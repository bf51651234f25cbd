"""Planning time (trace on the meta device + strategies + costs + ILP) for a few model sizes.

    .venv/bin/python benchmarks/bench_plan.py            # prints one line per case

Results and the machine they were measured on are recorded in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

import autopar
from autopar.examples import gpt2_tiny, llama_tiny


def case(name, build, batch, seq, vocab, cluster, mesh):
    with torch.device("meta"):
        model, _ = build()
    ids = torch.randint(0, vocab, (batch, seq))
    t0 = time.perf_counter()
    plan = autopar.plan(model, cluster, {"input_ids": ids, "labels": ids}, mesh_shape=mesh)
    dt = time.perf_counter() - t0
    p = plan.predicted
    print(
        f"{name:40s} mesh {str(plan.mesh_shape):10s} plan {dt:7.2f} s   predicted step {p.step_time_s * 1e3:9.2f} ms"
        f"   memory {p.peak_memory_bytes / 2**30:7.2f} GiB   ILP vars {plan.solver.num_variables}"
    )
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the small cases")
    args = ap.parse_args()
    print(
        f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    h100 = autopar.ClusterSpec.preset("h100-sxm")
    case("gpt2-small width, 2 layers, b8 s1024", lambda: gpt2_tiny(layers=2, hidden=768, vocab=50304),
         8, 1024, 50304, h100, (8,))  # fmt: skip
    case("gpt2-small width, 2 layers, b8 s1024", lambda: gpt2_tiny(layers=2, hidden=768, vocab=50304),
         8, 1024, 50304, h100, (2, 4))  # fmt: skip
    if args.quick:
        return
    for layers in (2, 4, 8):
        case(f"llama-8B width, {layers} layers, b8 s2048", lambda n=layers: llama_tiny(layers=n, hidden=4096, vocab=128256),
             8, 2048, 128256, h100, (8,))  # fmt: skip


if __name__ == "__main__":
    main()
