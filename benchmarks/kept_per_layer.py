"""What the cost tables keep for backward per layer, tensor by tensor, for a forced layout.

    .venv/bin/python benchmarks/kept_per_layer.py [--layers 2] [--cp 16] [--tp 8] [--seq 131072]

The Llama-3-405B shape (``examples.llama``, meta device, bf16 mixed precision, one sequence a
micro-batch) with ``--layers`` and ``--layers + 1`` layers, planned on ``cp x tp`` H100s with the
mesh forced to (sequence, tensor) and no recomputation; each plan's strategies looked up in cost
tables built as the search builds them (``passes/costs.py``). Prints, per node and edge of the
last layer (the difference of the two models, matched by class), the bytes kept on one device:
nodes (what an op keeps at itself), edges (what a consumer keeps by taking a tensor: a resharded
copy, or the storage as it is), and storages several consumers keep once (``Edge.keep``, their
largest). Set against Korthikanti et al. 2022's 34 s b h / t (sequence parallelism, no s^2 term),
with s the tokens on a device after the sequence split. Figures: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses

import torch

import autopar
from autopar import AxisRole, Offload, Outputs, Precision, Recompute
from autopar.examples import llama
from autopar.options import Optimizer
from autopar.passes.analyze import analyze
from autopar.passes.costs import build_costs
from autopar.passes.fuse import fuse
from autopar.passes.precision import half_infos
from autopar.passes.replay import table_indices
from autopar.passes.strategies import build_strategies
from autopar.passes.trace import Role, trace

SHAPE = dict(hidden=16384, ffn=53248, heads=128, kv_heads=8, batch=1, dtype="bfloat16")


def kept(layers: int, cp: int, tp: int, seq: int) -> dict[str, float]:
    """Bytes kept per device, by node / edge label (layer-independent: ``L`` for the layer)."""
    with torch.device("meta"):
        model, inputs = llama(layers=layers, seq=seq, **SHAPE)
    cluster = dataclasses.replace(autopar.ClusterSpec.parse(f"h100-sxm:{cp}x{tp}"), memory_reserve=0.0)
    mesh, roles = (cp, tp), (AxisRole.SEQUENCE, AxisRole.TENSOR)
    plan = autopar.plan(
        model, cluster, inputs, mesh_shape=mesh, axis_roles=roles, precision=Precision.BF16,
        pipeline_stages=1, recompute=Recompute.NONE, zero_stage=0, offload=Offload.NONE,
        outputs=Outputs.LOSS, memory_limit_bytes=4096 * 2**30,
    )  # fmt: skip
    tg = trace(model, inputs)
    fuse(tg, {u.kernel for u in plan.kernels})
    infos = analyze(tg)
    cinfos = half_infos(tg, infos, Precision.BF16, cluster.device.kind)
    strats = build_strategies(tg, infos, mesh, roles)
    tables = build_costs(
        tg, cinfos, strats, cluster, mesh, Optimizer.ADAM, roles, outputs=Outputs.LOSS,
        overlap_matmuls=plan.overlap_matmuls,
    )  # fmt: skip
    choice = table_indices(tables, plan)
    mods = {n.name: (n.meta.get("nn_module_stack") or {}) for n in tg.graph.nodes}

    def label(name: str) -> str:
        stack = list(mods.get(name, {}).values())
        path = stack[-1][0] if stack else ""
        parts = path.split(".")
        if "layers" in parts:  # model.layers.3.mlp.down_proj -> L.mlp.down_proj
            i = parts.index("layers")
            path = ".".join(["L"] + parts[i + 2 :])
        return f"{path or '-'}:{infos[name].target.split('.')[-2] if '.' in infos[name].target else infos[name].target}"

    out: dict[str, float] = collections.defaultdict(float)
    for v in tables.strategies:
        if infos[v].role in (Role.ACTIVATION, Role.INPUT):
            out["node " + label(v)] += tables.node_mem[v][choice[v]]
    shared: dict[str, float] = {}
    for e in tables.edges:
        a, b = choice[e.src], (choice[e.dst] if e.dst in choice else 0)
        if e.mem[a][b]:
            out[f"edge {label(e.src)} -> {label(e.dst) if e.dst in infos else e.dst}"] += e.mem[a][b]
        if e.owner:
            shared[e.owner] = max(shared.get(e.owner, 0.0), e.keep[a][b])
    for owner, b in shared.items():
        out[f"kept once for its consumers {label(owner)}"] += b
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--cp", type=int, default=16)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--seq", type=int, default=131072)
    a = ap.parse_args()
    small, big = kept(a.layers, a.cp, a.tp, a.seq), kept(a.layers + 1, a.cp, a.tp, a.seq)
    mib = 2**20
    rows = sorted(((big[k] - small.get(k, 0.0), k) for k in big), reverse=True)
    total = sum(d for d, _ in rows)
    for d, k in rows:
        if abs(d) >= 0.5 * mib:
            print(f"{d / mib:10.1f} MiB  {k}")
    s = a.seq // a.cp
    formula = 34 * s * SHAPE["hidden"] / a.tp
    print(
        f"per layer: {total / 2**30:.3f} GiB kept; Korthikanti's 34 s b h / t: {formula / 2**30:.3f} GiB (s = {s})"
    )


if __name__ == "__main__":
    main()
