"""The cost model's optimizer step against PyTorch's, per optimizer and parameter size.

In one process with one thread (as a gloo rank runs; glibc keeps freed memory, as
``autopar.launch`` asks it to), calibrate the fresh-tensor and in-place bandwidths and the
per-tensor figures (``autopar/tools/calibrate_compute.py``), then time ``step()`` of SGD, SGD with
momentum and Adam (PyTorch's defaults) over parameters of each size and print the measured time
against ``cost_model.compute.optimizer_step_time``, and against what a fused step would move
(read the parameter, gradient and states, write them back: ``2 + 2 c + 1`` passes at the
fresh-tensor bandwidth, where ``OPTIMIZER_TRAFFIC`` counts PyTorch's kernels' passes).

    .venv/bin/python benchmarks/bench_optimizer_step.py
"""

from __future__ import annotations

import dataclasses

import torch

from autopar.cluster import ClusterSpec
from autopar.cost_model.compute import optimizer_step_time
from autopar.launch import keep_freed_memory
from autopar.passes.costs import Optimizer
from autopar.tools.calibrate_compute import (
    OPTIMIZERS,
    measure_inplace_bandwidth,
    measure_memory_bandwidth,
    measure_optimizer,
    median_time,
)

# (elements per parameter, parameters): from a step of per-tensor overheads to one of bytes
CASES = ((2**14, 24), (2**18, 8), (2**20, 4), (2**22, 2))


def main() -> None:
    torch.set_num_threads(1)
    keep_freed_memory()
    cpu = torch.device("cpu")
    dev = dataclasses.replace(
        ClusterSpec.preset("cpu").device,
        memory_bandwidth=measure_memory_bandwidth(cpu, 5),
        inplace_bandwidth=measure_inplace_bandwidth(cpu, 5),
        optimizer_param_s=measure_optimizer(cpu, 5),
    )
    print(
        f"calibrated: memory {dev.memory_bandwidth / 1e9:.1f} GB/s, in place {dev.inplace_bw / 1e9:.1f} GB/s, "
        + ", ".join(f"{k} {v * 1e6:.1f} us/tensor" for k, v in dev.optimizer_param_s)
    )
    print(
        f"{'parameters':<16} {'optimizer':<13} {'measured ms':>12} {'model ms':>9} {'err':>6} {'fused ms':>9} {'err':>6}"
    )
    for numel, count in CASES:
        params = [torch.zeros(numel, requires_grad=True) for _ in range(count)]
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        for kind in Optimizer:
            opt = OPTIMIZERS[kind.name](params)
            opt.step()  # the states
            measured = median_time(opt.step, cpu, repeats=7, inner=3)
            model = count * optimizer_step_time(numel * 4, kind.value, dev, kind.name)
            fused = count * (
                numel * 4 * (3 + 2 * kind.value) / dev.memory_bandwidth + dev.optimizer_param(kind.name)
            )
            print(
                f"{count:>3} x {numel * 4 / 2**20:6.2f} MiB {kind.name:<13} {measured * 1e3:>12.3f} "
                f"{model * 1e3:>9.3f} {(model - measured) / measured * 100:>5.0f}% "
                f"{fused * 1e3:>9.3f} {(fused - measured) / measured * 100:>5.0f}%"
            )


if __name__ == "__main__":
    main()
