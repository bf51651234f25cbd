"""Host time that DTensor parameters add to a step, per parameter: what is left of the generated
module's overhead over eager on a launch-bound GPU step (``benchmarks/README.md``, "The runtime on
one GPU").

One process, world 1, ``--params`` small parameters (default 220: a 24-layer Llama's count), one
thread. Per step, median of ``--steps``:

* ``plain``: each parameter read as is, summed, backward;
* ``to_local``: each a ``DTensor`` parameter read through ``DTensor.to_local()`` (what the
  generated code does: ``codegen/collectives.py:local``), summed, backward (the gradient flows
  back as a ``DTensor``);
* ``AdamW plain`` / ``AdamW DTensor``: one ``foreach`` AdamW step over the plain / the ``DTensor``
  parameters.

The tensors are tiny (``--size`` x ``--size``): the figures are host time, which a GPU step pays
when its kernels are short.

    .venv/bin/python benchmarks/bench_dtensor_overhead.py [--params 220 --size 8 --steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate


def _median_ms(fn, steps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=220)
    ap.add_argument("--size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    store = tempfile.mktemp(prefix="bench_dtensor_")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    n, s = args.params, args.size
    plain = [torch.nn.Parameter(torch.randn(s, s)) for _ in range(n)]
    dtensors = [
        torch.nn.Parameter(DTensor.from_local(torch.randn(s, s), mesh, [Replicate()])) for _ in range(n)
    ]

    def step(params, read):
        def run():
            sum(read(p).sum() for p in params).backward()
            for p in params:
                p.grad = None

        return run

    def adam(params):
        opt = torch.optim.AdamW(params, foreach=True)
        for p in params:
            p.grad = torch.zeros_like(p)
        return opt.step

    rows = {
        "plain": _median_ms(step(plain, lambda p: p), args.steps),
        "to_local": _median_ms(step(dtensors, lambda p: p.to_local()), args.steps),
        "AdamW plain": _median_ms(adam(plain), args.steps),
        "AdamW DTensor": _median_ms(adam(dtensors), args.steps),
    }
    print(
        f"torch {torch.__version__}, {n} parameters of {s}x{s}, one thread: ms per step (median of {args.steps})"
    )
    for name, ms in rows.items():
        print(f"  {name:<14} {ms:8.2f} ms  ({ms * 1e3 / n:7.1f} us per parameter)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
