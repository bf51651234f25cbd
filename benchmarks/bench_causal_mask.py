"""What turning traced causal masks back into ``is_causal=True`` (passes/causal_mask.py) buys.

Three readings, each with the graph as captured (``trace(..., causal_masks=False)``: SDPA with the
materialized ``(batch, 1, L, S)`` boolean mask) against the rewritten one (``is_causal=True``, no
mask), measured alternately in one process:

* ``sdpa``: forward + backward of one ``scaled_dot_product_attention`` call at
  ``(batch, heads, seq, 64)``, masked against causal, in ``--dtype``;
* ``graph``: forward + backward of the whole traced Hugging Face model (Llama, GPT-2 at
  ``benchmarks/bench_gpu.py``'s ``small`` size unless ``--seq``), the traced graph module run on
  the model's fp32 weights under ``--dtype`` autocast (bf16: what the plan runs for a bf16 model;
  float32: no autocast);
* ``pass``: the seconds the pass itself adds to tracing, on a Llama built on the meta device at
  batch 8 and sequence 4096 (the mask it evaluates on the CPU is 8 x 4096 x 4096), or at
  ``--pass-only BATCHxSEQ`` alone (``128x131072``: the 128K-context row's mask, too large to hold,
  proven from its diagonals; ``--blocks-only``: element by element, in blocks of rows).

``--clock cpu`` times this process's CPU seconds instead of the wall clock (``--threads 1``: the
work itself, less what other processes on a shared machine take from it). Median of
``--repeats`` timings after one warm-up, the two variants run in turn within each
repeat. ``autopar``'s own step (``bench_gpu.py``)
includes the same difference plus the plan's collectives (none at world 1).

    python benchmarks/bench_causal_mask.py [--repeats 5] [--seq 128] [--dtype bfloat16]
                                           [--threads N] [--clock wall|cpu]
                                           [--pass-only BATCHxSEQ [--blocks-only]]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from autopar import examples
from autopar.passes import causal_mask
from autopar.passes.causal_mask import SDPA
from autopar.passes.trace import trace
from autopar.tools.validate import placeholder_values

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def _interleaved_s(fns, repeats: int) -> list[float]:
    """The median seconds of each of ``fns`` (on ``clock``), run in turn within every repeat (after
    one warm-up round), so that a load that comes and goes on the machine reaches each alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, times):
            t0 = clock()
            fn()
            t.append(clock() - t0)
    return [statistics.median(t) for t in times]


def bench_sdpa(batch: int, heads: int, seq: int, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, 64, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    mask = torch.ones(seq, seq, dtype=torch.bool).tril().expand(batch, 1, seq, seq).contiguous()

    def masked():
        SDPA(q, k, v, mask).sum().backward()

    def causal():
        SDPA(q, k, v, is_causal=True).sum().backward()

    masked_s, causal_s = _interleaved_s([masked, causal], repeats)
    return masked_s, causal_s


def bench_graph(name: str, seq: int, dtype: torch.dtype, repeats: int) -> tuple[float, float, int, int]:
    """(captured s, rewritten s, captured nodes, rewritten nodes) of one forward + backward."""
    layers, hidden, heads, batch, vocab = 2, 256, 4, 4, 4096  # bench_gpu.py's "small"
    if name == "llama":
        model, inputs = examples.llama(
            layers=layers, hidden=hidden, ffn=int(hidden * 8 / 3) // 64 * 64, heads=heads, kv_heads=1,
            vocab=vocab, batch=batch, seq=seq, dtype="float32",
        )  # fmt: skip
    else:
        model, inputs = examples.gpt(
            layers=layers, hidden=hidden, heads=heads, vocab=vocab, batch=batch, seq=seq, dtype="float32"
        )
    steps, sizes = [], []
    for rewrite in (False, True):
        tg = trace(model, inputs, causal_masks=rewrite)
        args = placeholder_values(tg, inputs, seed=0)
        args = [a.detach().requires_grad_() if a.is_floating_point() else a for a in args]

        def step(tg=tg, args=args):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = tg.graph_module(*args)[0]
            loss.backward()

        steps.append(step)
        sizes.append(len(tg.graph.nodes))
    before, after = _interleaved_s(steps, repeats)
    return before, after, sizes[0], sizes[1]


def bench_pass(repeats: int, batch: int = 8, seq: int = 4096) -> tuple[float, float]:
    with torch.device("meta"):
        model, _ = examples.llama_tiny(layers=2, hidden=256, vocab=320)
    ids = torch.randint(0, 320, (batch, seq))
    inputs = {"input_ids": ids, "labels": ids}
    off, on = _interleaved_s(
        [lambda: trace(model, inputs, causal_masks=False), lambda: trace(model, inputs)], repeats
    )
    return off, on


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="cpu: this process's CPU seconds")
    ap.add_argument(
        "--pass-only",
        metavar="BATCHxSEQ",
        default=None,
        help="only the pass's reading, at this batch and sequence (128x131072: the 128K-context row)",
    )
    ap.add_argument(
        "--blocks-only",
        action="store_true",
        help="prove masks too large to hold in blocks of rows only, not from their diagonals",
    )
    args = ap.parse_args()
    if args.blocks_only:  # what the proof costs where a mask is not shown to depend on j - i alone
        causal_mask.diagonal_vector = lambda *_: None
    global clock
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock")
    if args.pass_only:
        batch, seq = (int(x) for x in args.pass_only.split("x"))
        off, on = bench_pass(args.repeats, batch, seq)
        print(
            f"trace of a meta Llama, batch {batch}, seq {seq}: {off:.2f} s without the pass, {on:.2f} s with it"
        )
        return
    print(f"sdpa fwd+bwd, {args.dtype}: (batch, heads, seq, 64)  masked ms  causal ms  causal/masked")
    for seq in (128, 512, 1024):
        masked, causal = bench_sdpa(4, 4, seq, dtype, args.repeats)
        print(
            f"  (4, 4, {seq:>4}, 64) {masked * 1e3:>20.2f} {causal * 1e3:>10.2f} {causal / masked - 1:>+13.1%}"
        )
    print(f"graph fwd+bwd, {args.dtype}, seq {args.seq}:  captured ms  rewritten ms  change  nodes")
    for name in ("llama", "gpt2"):
        before, after, n0, n1 = bench_graph(name, args.seq, dtype, args.repeats)
        print(
            f"  {name:<6} {before * 1e3:>32.2f} {after * 1e3:>13.2f} {after / before - 1:>+7.1%}  {n0} -> {n1}"
        )
    off, on = bench_pass(max(args.repeats // 2, 1))
    print(f"trace of a meta Llama, batch 8, seq 4096: {off:.2f} s without the pass, {on:.2f} s with it")


if __name__ == "__main__":
    main()
