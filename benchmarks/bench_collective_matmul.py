"""Collective matmuls against the unfused collective + linear: seconds per forward + backward.

On ``--world`` gloo ranks (one core each where the host has them, ``autopar.launch``), for a few
shapes of Megatron-style sequence parallelism: ``all_gather`` of the sequence then a
column-parallel linear (the gathered input's gradient reduce-scattered), against
``all_gather_linear``; a row-parallel linear then ``reduce_scatter`` of the sequence, against
``linear_reduce_scatter``. Both sides are ``autopar.codegen.collectives``' functions on one mesh
axis, as the generated code calls them; timed in interleaved rounds (the slowest rank's step,
median over rounds, ``autopar.tools.measure.time_interleaved``). Also printed: what the cost
model predicts each fused form hides on the cluster's figures (``--cluster``, default the ``cpu``
preset, whose ``comm_overlap`` of 0 predicts nothing hidden).

    .venv/bin/python benchmarks/bench_collective_matmul.py [--world 2] [--rounds 15] [--cluster c.json]
"""

from __future__ import annotations

import argparse

import torch

import autopar
from autopar.launch import run_on_ranks
from autopar.tools.measure import time_interleaved

# (batch, sequence, hidden in, hidden out): the linear's global shapes
SHAPES = [(1, 256, 256, 1024), (1, 1024, 512, 2048), (4, 1024, 1024, 1024)]


def _steps(mesh, world: int, shape: tuple[int, int, int, int]) -> dict:
    """One forward + backward of each of the four forms on ``shape``, as callables."""
    from autopar.codegen import collectives as C

    b, s, h_in, h_out = shape
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.functional.linear
    # column-parallel: this rank's rows of the sequence, its block of output features
    x = torch.randn(b, s // world, h_in, generator=g, requires_grad=True)
    w_col = torch.randn(h_out // world, h_in, generator=g, requires_grad=True)
    # row-parallel: the whole sequence, this rank's block of input features
    xr = torch.randn(b, s, h_in // world, generator=g, requires_grad=True)
    w_row = torch.randn(h_out, h_in // world, generator=g, requires_grad=True)

    def step(fn):
        def run():
            with C.bound_mesh(mesh):
                y = fn()
            y.sum().backward()

        return run

    return {
        "gather+linear": step(lambda: linear(C.all_gather(x, 1, 0, True), w_col)),
        "all_gather_linear": step(lambda: C.all_gather_linear(x, w_col, None, 1, 0, True)),
        "linear+scatter": step(lambda: C.reduce_scatter(linear(xr, w_row), 1, 0)),
        "linear_reduce_scatter": step(lambda: C.linear_reduce_scatter(xr, w_row, None, 1, 0)),
    }


def _rank(rank: int, world: int, rounds: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return {shape: time_interleaved(_steps(mesh, world, shape), rounds) for shape in SHAPES}


def _predicted(cluster: autopar.ClusterSpec, world: int) -> dict:
    """Seconds the cost model says each fused form hides, per shape (float32, forward + backward)."""
    from autopar.cost_model.comm import CommModel
    from autopar.cost_model.compute import node_time
    from autopar.cost_model.overlap import ring_hidden_s
    from autopar.reshard import Collective

    comm, e = CommModel(cluster, (world,)), cluster.device.comm_overlap
    out = {}
    for b, s, h_in, h_out in SHAPES:
        flops = 2 * b * s * h_in * h_out / world
        nbytes = 4 * (b * s * h_in + h_in * h_out / world + b * s * h_out / world)
        t = node_time(flops, nbytes, torch.float32, cluster.device, 1, True, new_grads=2)
        t *= cluster.compute_slowdown
        gather = comm.time(Collective.ALL_GATHER, 4 * b * s * h_in, 0)
        scatter = comm.time(Collective.REDUCE_SCATTER, 4 * b * s * h_out, 0)
        out[(b, s, h_in, h_out)] = tuple(
            ring_hidden_s(c, t / 3, world, e) + ring_hidden_s(c, 2 * t / 3, world, e)
            for c in (gather, scatter)
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--cluster", default=None, help="a cluster spec file (default: the cpu preset)")
    args = ap.parse_args()
    cluster = (
        autopar.ClusterSpec.from_file(args.cluster)
        if args.cluster
        else autopar.ClusterSpec.preset("cpu", devices_per_node=args.world)
    )
    measured = run_on_ranks(_rank, args.world, args.rounds, timeout_s=1800)[0]
    predicted = _predicted(cluster, args.world)
    print(
        f"world {args.world}, gloo; ms per forward + backward (slowest rank, median of {args.rounds} rounds)"
    )
    print(f"{'shape (B, S, in, out)':26s} {'AG+linear':>10s} {'fused':>8s} {'linear+RS':>10s} {'fused':>8s}"
          f"   predicted hidden (AG, RS) ms")  # fmt: skip
    for shape, t in measured.items():
        hid = predicted[shape]
        print(
            f"{shape!s:26s} {t['gather+linear'] * 1e3:10.3f} {t['all_gather_linear'] * 1e3:8.3f} "
            f"{t['linear+scatter'] * 1e3:10.3f} {t['linear_reduce_scatter'] * 1e3:8.3f}"
            f"   {hid[0] * 1e3:.3f}, {hid[1] * 1e3:.3f}"
        )


if __name__ == "__main__":
    main()
