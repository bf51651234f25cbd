"""2D, 2.5D and 3D tensor parallelism against 1D (Megatron), priced by the same cost model: where each wins.

    .venv/bin/python benchmarks/bench_tp_nd.py [--no-search] [--cube] [--size NAME ...]

Part 1, one transformer layer, priced. GPT-3 layer shapes (1.3B: h 2048; 13B: h 5120; 175B:
h 12288), bf16, one micro-batch of 1 x 2048 tokens (``T``), on ``h100-sxm`` clusters of 4 (one
node of 4), 16 and 64 GPUs (nodes of 8), ``P`` GPUs in all:

* 1D: Megatron tensor parallelism over all ``P`` GPUs (mesh ``(P,)``): per layer two all-reduces
  of the ``[T, h]`` activation forward (after attention, after the MLP) and two backward (the
  "f" before each column-parallel pair); the layer's input is whole on every GPU.
* 2D: a ``q x q`` grid (mesh ``(q, q)``, ``P = q^2``), the layer's four matmuls (QKV h -> 3h, out
  h -> h, FC1 h -> 4h, FC2 4h -> h) each as the registered lowering describes it
  (``autopar/lowerings/matmul_nd.py``: ``X``'s ``K`` blocks all-gathered over one axis, ``W``'s over
  the other, the gradients reduce-scattered backward); the layer's input is split ``P`` ways.

Columns: bytes each GPU sends per layer (ring: ``(n-1)/n`` of a gathered or reduce-scattered
tensor, ``2 (n-1)/n`` of an all-reduced one), their seconds (``cost_model/comm.py:CommModel.time``,
the cheapest of ring, tree and hierarchical, no overlap), the four matmuls' forward + backward
compute at the device's bf16 peak divided over ``P`` (for scale; the same for both), and the
bytes of the layer's input each GPU holds (what the elementwise ops and norms run on).

Part 2, the search (``--no-search`` skips it): one layer of each size on the meta device, built
as a Llama (``autopar.examples.llama``: GPT-3's hidden size and heads, an MLP of 4h, vocabulary
51200; GPT-3's learned positions, 2050 rows, divide over no tensor axis), one micro-batch of 1
or 8 sequences, planned on the mesh ``(q, q)`` (the 2D strategies offered beside every per-axis
one) and on ``(P,)`` (no 2D possible), every axis ``TENSOR`` (tensor parallelism alone: 2D
against 1D) or ``AUTO`` (any split, data parallelism included): how many of its eight linears
(seven and the head) the search runs as 2D matmuls, and each plan's predicted step and peak
memory.

Part 3, 2D, 2.5D and 3D against 1D on the cubes of 8 (2 x 2 x 2, one node) and 64 GPUs (4 x 4 x 4,
nodes of 8; ``cube_rows``), priced alike per layer as in part 1, 1 or 8 sequences a micro-batch
(the depth splits the tokens; at one sequence that is a split of its positions, priced the same): 1D over all ``P``; 2D on ``sqrt(P) x sqrt(P)`` where ``P`` is a square (64: 8 x 8); 2.5D,
the 2D lowering on the inner ``q x q`` of the cube with its depth ``q`` over the batch; 3D, the
registered 3D lowering on the cube (``X``'s sequence gathered over axis 1, the product
reduce-scattered over axis 2, the batch over axis 0). 2.5D and 3D keep the weights whole over the
depth axis, so each also pays its weights' gradient all-reduce over it (data parallelism's, what
Colossal-AI's gather of the weight forward and its reduce-scatter backward cost together); 1D and
2D split the weights over all ``P`` and pay none. Columns as part 1's, and the weight bytes each
GPU holds. Then the search on those cubes (``cube_search_rows``, 8 sequences): axis 0 ``DATA`` (the
depth), the grid ``TENSOR`` (every axis ``TENSOR`` places no 2-D parameter on three axes), with the
2D and 3D strategies offered beside every per-axis one, with all of them withheld, and 1D over
``P``.

Figures, with the machine and the command, are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import platform
import time

import torch

import autopar
from autopar.cost_model.comm import CommModel
from autopar.lowerings import Collective, describe, price_calls
from autopar.lowerings.matmul_nd import cube_axes, grid_axes
from autopar.options import AxisRole
from autopar.placement import Matmul2D, Matmul3D, Outputs, Shard, volume_factor
from autopar.tools.validate import node_strategies, one_node_graph

aten = torch.ops.aten
SEQ = 2048
TOKENS = (2048, 16384)  # one micro-batch: 1 or 8 sequences of SEQ
BF16 = 2
SIZES = {"gpt3-1.3b": (2048, 16), "gpt3-13b": (5120, 40), "gpt3-175b": (12288, 96)}  # hidden, heads
CLUSTERS = {4: (1, 4), 16: (2, 8), 64: (8, 8)}  # GPUs -> (nodes, GPUs per node)


def cluster_of(gpus: int) -> autopar.ClusterSpec:
    nodes, per_node = CLUSTERS[gpus]
    return autopar.ClusterSpec.preset("h100-sxm", nodes=nodes, devices_per_node=per_node)


def sent(kind: Collective, nbytes: float, n: int) -> float:
    """Bytes one rank sends, on average, in a collective of ``nbytes`` (the model's byte
    convention): a ring's, or a chain's for a broadcast or reduce (all ranks but one send the
    tensor once)."""
    return (2 if kind is Collective.ALL_REDUCE else 1) * (n - 1) / n * nbytes


def one_d(h: int, tokens: int, gpus: int, cluster) -> tuple[float, float]:
    """(bytes sent per GPU, seconds) of a Megatron layer's four all-reduces on mesh ``(P,)``."""
    comm = CommModel(cluster, (gpus,))
    act = tokens * h * BF16
    return 4 * sent(Collective.ALL_REDUCE, act, gpus), 4 * comm.time(Collective.ALL_REDUCE, act, 0)


def two_d(h: int, tokens: int, gpus: int, cluster, via: Matmul2D) -> tuple[float, float, float]:
    """(bytes sent per GPU, seconds, seconds not hidden behind the matmuls' compute at peak) of
    the layer's four matmuls as 2D matmuls by ``via`` on ``(q, q)``."""
    q = math.isqrt(gpus)
    mesh = (q, q)
    comm = CommModel(cluster, mesh)
    peak = cluster.device.peak_flops_for("bfloat16")
    total_b = total_s = exposed = 0.0
    for k, n in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)):
        x = torch.empty(tokens, k, dtype=torch.bfloat16, device="meta")
        w = torch.empty(n, k, dtype=torch.bfloat16, device="meta")
        node, _ = one_node_graph(
            aten.linear.default, (x, w, torch.empty(n, dtype=torch.bfloat16, device="meta"))
        )
        s = next(s for s in node_strategies(node, mesh) if grid_axes(node, s) == (0, 1) and s.via[0] is via)
        calls = describe(node, s, mesh).calls
        for c in calls:
            total_b += sent(c.kind, c.nbytes, mesh[c.axis])
            total_s += comm.time(c.kind, c.nbytes, c.axis)
        compute_s = 3 * 2 * tokens * k * n / gpus / peak
        exposed += sum(
            t for _, t in price_calls(calls, lambda c: comm.time(c.kind, c.nbytes, c.axis), compute_s)
        )
    return total_b, total_s, exposed


def layer(h: int, tokens: int, cluster, mesh, fits, depth: int | None = None) -> tuple[float, float, float]:
    """(bytes sent per GPU, seconds, weight bytes held per GPU) of the layer's four matmuls on
    ``mesh`` under the first strategy ``fits(node, s)`` of each, their calls as the registered
    lowering describes them; ``depth``: an axis over which the input's batch (dim 0) is split and
    the weights are whole, whose gradient all-reduce is added."""
    comm = CommModel(cluster, mesh)
    rows = mesh[depth] if depth is not None else 1
    total_b = total_s = held = 0.0
    for k, n in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)):
        x = torch.empty(rows, tokens // rows, k, dtype=torch.bfloat16, device="meta")
        w = torch.empty(n, k, dtype=torch.bfloat16, device="meta")
        b = torch.empty(n, dtype=torch.bfloat16, device="meta")
        node, _ = one_node_graph(aten.linear.default, (x, w, b))
        s = next(s for s in node_strategies(node, mesh) if fits(node, s))
        for c in describe(node, s, mesh).calls:
            total_b += sent(c.kind, c.nbytes, mesh[c.axis])
            total_s += comm.time(c.kind, c.nbytes, c.axis)
        w_local = n * k * BF16 / volume_factor(s.ins[1], mesh)
        held += w_local
        if depth is not None:  # the weight's gradient summed over the depth, as data parallelism's
            total_b += sent(Collective.ALL_REDUCE, w_local, mesh[depth])
            total_s += comm.time(Collective.ALL_REDUCE, w_local, depth)
    return total_b, total_s, held


def cube_rows(sizes) -> None:
    """Part 3 of the module docstring: 1D, 2D, 2.5D and 3D per layer on the cubes of 8 and 64."""
    print(
        "\n| size | tokens | GPUs | sent / GPU: 1D, 2D, 2.5D, 3D | comm: 1D, 2D, 2.5D, 3D | matmuls at peak "
        "| weights / GPU: 1D and 2D, 2.5D and 3D |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, tokens in itertools.product(sizes, TOKENS):
        h, _ = SIZES[name]
        for gpus, (nodes, per_node) in ((8, (1, 8)), (64, (8, 8))):
            cluster = autopar.ClusterSpec.preset("h100-sxm", nodes=nodes, devices_per_node=per_node)
            q = round(gpus ** (1 / 3))
            cube = (q, q, q)
            b1, t1 = one_d(h, tokens, gpus, cluster)
            flops = 3 * 2 * tokens * 12 * h * h
            mm_s = flops / gpus / cluster.device.peak_flops_for("bfloat16")
            two = "-", "-"
            r = math.isqrt(gpus)
            if r * r == gpus:
                b2, t2, _ = layer(
                    h, tokens, cluster, (r, r),
                    lambda n, s: grid_axes(n, s) == (0, 1) and s.via[0] is Matmul2D.GATHERED,
                )  # fmt: skip
                two = f"{b2 / 2**20:.0f}", f"{t2 * 1e3:.2f}"

            def depth_split(n, s):
                return s.ins[0][0] == s.out[0] == Shard(0)

            b25, t25, w25 = layer(
                h, tokens, cluster, cube,
                lambda n, s: grid_axes(n, s) == (1, 2) and s.via[1] is Matmul2D.GATHERED and depth_split(n, s),
                depth=0,
            )  # fmt: skip
            b3, t3, w3 = layer(
                h, tokens, cluster, cube,
                lambda n, s: (cube_axes(n, s) or (0,))[:2] == (1, 2) and depth_split(n, s),
                depth=0,
            )  # fmt: skip
            w1 = 12 * h * h * BF16 / gpus
            print(
                f"| {name} | {tokens} | {gpus} ({q}x{q}x{q}) | {b1 / 2**20:.0f}, {two[0]}, {b25 / 2**20:.0f}, {b3 / 2**20:.0f} MiB "
                f"| {t1 * 1e3:.2f}, {two[1]}, {t25 * 1e3:.2f}, {t3 * 1e3:.2f} ms | {mm_s * 1e3:.2f} ms "
                f"| {w1 / 2**20:.0f}, {w25 / 2**20:.0f} and {w3 / 2**20:.0f} MiB |",
                flush=True,
            )


def cube_search_rows(sizes) -> None:
    """Part 3's search: one layer, 8 sequences, on the cube of 8 and of 64 GPUs."""
    from autopar.examples import llama

    print(
        "\n| size | tokens | GPUs | roles | mesh | 2D, 3D linears | predicted step | peak memory | planned in |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in sizes:
        h, heads = SIZES[name]
        with torch.device("meta"):
            model, inputs = llama(
                layers=1, hidden=h, ffn=4 * h, heads=heads, kv_heads=heads, vocab=51200, batch=8, seq=SEQ
            )
        for gpus, (nodes, per_node) in ((8, (1, 8)), (64, (8, 8))):
            cluster = autopar.ClusterSpec.preset("h100-sxm", nodes=nodes, devices_per_node=per_node)
            q = round(gpus ** (1 / 3))
            T, D = AxisRole.TENSOR, AxisRole.DATA
            label = f"| {name} | {8 * SEQ} | {gpus} |"
            # every axis TENSOR places no 2-D parameter (the embedding) on three axes: no plan
            roles = (D, T, T)
            tag = ", ".join(r.value for r in roles)
            search_row(f"{label} {tag} |", model, inputs, cluster, (q, q, q), roles)
            with grid_withheld():
                search_row(f"{label} {tag}, no 2D/3D |", model, inputs, cluster, (q, q, q), roles)
            search_row(f"{label} tensor |", model, inputs, cluster, (gpus,), T)


def priced_rows(sizes) -> None:
    print(
        "| size | tokens | GPUs | sent / GPU: 1D, 2D, SUMMA | comm: 1D, 2D, SUMMA (exposed) | matmuls at peak "
        "| layer input / GPU, 1D / 2D |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in sizes:
        h, _ = SIZES[name]
        for tokens in TOKENS:
            for gpus in CLUSTERS:
                cluster = cluster_of(gpus)
                flops = 3 * 2 * tokens * 12 * h * h  # forward + backward of the four matmuls
                mm_s = flops / gpus / cluster.device.peak_flops_for("bfloat16")
                b1, t1 = one_d(h, tokens, gpus, cluster)
                b2, t2, _ = two_d(h, tokens, gpus, cluster, Matmul2D.GATHERED)
                b3, t3, e3 = two_d(h, tokens, gpus, cluster, Matmul2D.SUMMA)
                held = tokens * h * BF16 / 2**20
                q = math.isqrt(gpus)
                print(
                    f"| {name} | {tokens} | {gpus} ({q}x{q}) | {b1 / 2**20:.0f}, {b2 / 2**20:.0f}, "
                    f"{b3 / 2**20:.0f} MiB | {t1 * 1e3:.2f}, {t2 * 1e3:.2f}, {t3 * 1e3:.2f} ({e3 * 1e3:.2f}) ms | "
                    f"{mm_s * 1e3:.2f} ms | {held:.1f} / {held / gpus:.2f} MiB |",
                    flush=True,
                )


def searched_rows(sizes) -> None:
    from autopar.examples import llama

    print(
        "\n| size | tokens | GPUs | roles | mesh | 2D linears | predicted step | peak memory | planned in |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in sizes:
        h, heads = SIZES[name]
        for tokens in TOKENS:
            with torch.device("meta"):
                model, inputs = llama(
                    layers=1, hidden=h, ffn=4 * h, heads=heads, kv_heads=heads, vocab=51200,
                    batch=tokens // SEQ, seq=SEQ,
                )  # fmt: skip
            for gpus in CLUSTERS:
                cluster = cluster_of(gpus)
                q = math.isqrt(gpus)
                for role in (AxisRole.TENSOR, AxisRole.AUTO):
                    for mesh in ((q, q), (gpus,)):
                        search_row(
                            f"| {name} | {tokens} | {gpus} | {role.value} |",
                            model,
                            inputs,
                            cluster,
                            mesh,
                            role,
                        )


@contextlib.contextmanager
def grid_withheld():
    """The search without the 2D and 3D strategies (``passes/strategies.py:grid_strategies`` offers
    none), to read what they add to a plan."""
    import autopar.passes.strategies as strategies

    offer = strategies.grid_strategies
    strategies.grid_strategies = lambda *args, **kwargs: []
    try:
        yield
    finally:
        strategies.grid_strategies = offer


def depth_rows() -> None:
    """2.5D (Tesseract): a ``d x q x q`` mesh, the outer axis ``DATA`` (the depth: the batch split,
    the weights whole), the grid ``TENSOR``, with and without the 2D strategies offered; beside
    data x 1D tensor parallelism on ``(P / q', q')``. 8 sequences; 16 and 64 GPUs."""
    from autopar.examples import llama

    print(
        "\n| size | tokens | GPUs | roles | mesh | 2D linears | predicted step | peak memory | planned in |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in ("gpt3-13b", "gpt3-175b"):
        h, heads = SIZES[name]
        with torch.device("meta"):
            model, inputs = llama(
                layers=1, hidden=h, ffn=4 * h, heads=heads, kv_heads=heads, vocab=51200, batch=8, seq=SEQ
            )
        for gpus, meshes in ((16, ((4, 2, 2), (4, 4))), (64, ((4, 4, 4), (8, 8)))):
            for mesh in meshes:
                roles = (AxisRole.DATA,) + (AxisRole.TENSOR,) * (len(mesh) - 1)
                label = f"| {name} | {8 * SEQ} | {gpus} | {', '.join(r.value for r in roles)} |"
                search_row(label, model, inputs, cluster_of(gpus), mesh, roles)
                if len(mesh) == 3:
                    with grid_withheld():
                        search_row(
                            label.replace("tensor |", "tensor, no 2D |"),
                            model,
                            inputs,
                            cluster_of(gpus),
                            mesh,
                            roles,
                        )


def limited_rows() -> None:
    """175B's layer at 8 sequences on 4 GPUs (2 x 2, ``TENSOR``) under memory limits: where the
    gathered operands no longer fit, the search runs SUMMA (it keeps nothing gathered)."""
    from autopar.examples import llama

    h, heads = SIZES["gpt3-175b"]
    with torch.device("meta"):
        model, inputs = llama(
            layers=1, hidden=h, ffn=4 * h, heads=heads, kv_heads=heads, vocab=51200, batch=8, seq=SEQ
        )
    print(
        "\n| size | tokens | GPUs | roles | memory limit | 2D linears | predicted step | peak memory | planned in |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for limit in (None, 23, 22.5, 22):
        search_row(
            f"| gpt3-175b | {8 * SEQ} | 4 | tensor | {f'{limit} GiB' if limit else 'none'} |", model, inputs, cluster_of(4),
            None, AxisRole.TENSOR, None if limit is None else limit * 2**30,
        )  # fmt: skip


def search_row(label: str, model, inputs, cluster, mesh, role, limit=None) -> None:
    """One plan's row; ``mesh`` None: the 2 x 2 mesh of the memory-limited rows (not printed);
    ``role``: every axis's, or a tuple of them."""
    shown = mesh is not None
    mesh = mesh or (2, 2)
    roles = role if isinstance(role, tuple) else (role,) * len(mesh)
    t0 = time.perf_counter()
    try:
        plan = autopar.plan(
            model, cluster, inputs, mesh_shape=mesh, axis_roles=roles, outputs=Outputs.LOCAL,
            pipeline_stages=1, memory_limit_bytes=limit,
        )  # fmt: skip
    except autopar.NoPlanFitsError as e:
        print(
            f"{label}{' ' + 'x'.join(map(str, mesh)) + ' |' if shown else ''} no plan: {e} | | | |",
            flush=True,
        )
        return
    dt = time.perf_counter() - t0
    linear = [d for d in plan.decisions if d.op == "aten.linear.default"]
    grid = " + ".join(
        f"{sum(v.value in d.via.split(',') for d in linear)} {v.value}" for v in (*Matmul2D, *Matmul3D)
    )
    p = plan.predicted
    print(
        f"{label}{' ' + 'x'.join(map(str, mesh)) + ' |' if shown else ''} {grid} of {len(linear)} | {p.step_time_s * 1e3:.2f} ms | "
        f"{p.peak_memory_bytes / 2**30:.2f} GiB | {dt:.1f} s |",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", action="append", choices=list(SIZES), help="only these (repeatable)")
    ap.add_argument("--no-search", action="store_true", help="the priced layer only")
    ap.add_argument("--cube", action="store_true", help="part 3 only: 1D, 2D, 2.5D and 3D on cubes")
    args = ap.parse_args()
    sizes = args.size or list(SIZES)
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}")
    if args.cube:
        cube_rows(sizes)
        if not args.no_search:
            cube_search_rows(sizes)
        return
    priced_rows(sizes)
    cube_rows(sizes)
    if not args.no_search:
        cube_search_rows(sizes)
        searched_rows(sizes)
        depth_rows()
        limited_rows()


if __name__ == "__main__":
    main()
