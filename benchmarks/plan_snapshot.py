"""Snapshot what the search decides and what codegen emits, to show a refactor changes neither.

    .venv/bin/python benchmarks/plan_snapshot.py --save DIR      # on the code before the change
    .venv/bin/python benchmarks/plan_snapshot.py --compare DIR   # on the code after it

For every example model (on the ``cpu`` preset with 2 and 4 ranks, automatic and with data or
tensor parallelism forced, and on 8 H100s) and the small planning benchmark cases
(``bench_plan.py --quick``, ``bench_solver.py``'s gpt2-small), it records each plan's decisions
(placements per node), predicted step time, memory and per-node seconds, and the rank-local code
codegen emits for it (lowered with meta-device shards: no process group). ``--compare`` prints,
per case, whether the placements and the generated code are identical and the largest relative
difference of any predicted figure; it exits 1 when placements or code differ or a figure moves
by more than ``--rtol`` (0.1% by default).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

import autopar
from autopar import examples
from autopar.api import search


def _cases():
    """(case name, builder, cluster, keyword arguments of ``autopar.plan``)."""
    cpu2 = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    cpu4 = autopar.ClusterSpec.preset("cpu", devices_per_node=4)
    h100 = autopar.ClusterSpec.preset("h100-sxm")
    data, tensor = (autopar.AxisRole.DATA,), (autopar.AxisRole.TENSOR,)
    out = []
    for name in ("gpt2_tiny", "llama_tiny", "bert_tiny", "t5_tiny", "vit_tiny", "mlp", "palm_tiny"):
        build = getattr(examples, name)
        out.append((f"{name}-cpu2-auto", build, cpu2, {}))
        out.append((f"{name}-cpu4-auto", build, cpu4, {}))
        out.append((f"{name}-cpu2-data", build, cpu2, {"axis_roles": data}))
        out.append((f"{name}-cpu2-tensor", build, cpu2, {"axis_roles": tensor}))
        out.append((f"{name}-cpu4-2x2", build, cpu4, {"mesh_shape": (2, 2)}))
        out.append((f"{name}-h100x8-auto", build, h100, {}))
    out.append(("gpt2_tiny-cpu4-local", examples.gpt2_tiny, cpu4, {"outputs": autopar.Outputs.LOCAL}))
    out.append(
        (
            "bench_plan-gpt2-768-8",
            lambda: examples.gpt2_tiny(layers=2, hidden=768, vocab=50304, batch=8, seq=1024),
            h100,
            {"mesh_shape": (8,)},
        )
    )
    out.append(
        (
            "bench_plan-gpt2-768-2x4",
            lambda: examples.gpt2_tiny(layers=2, hidden=768, vocab=50304, batch=8, seq=1024),
            h100,
            {"mesh_shape": (2, 4)},
        )
    )
    out.append(
        (
            "llama-2048-4L-2x4",
            lambda: examples.llama(
                layers=4, hidden=2048, ffn=5632, heads=16, kv_heads=4, vocab=32000, batch=16, seq=2048
            ),
            h100,
            {"mesh_shape": (2, 4), "memory_limit_bytes": float("inf")},
        )
    )
    return out


def _code(result) -> str:
    """The rank-local code codegen emits for the plan (meta shards; no process group)."""
    from autopar.codegen.lower import lower, mangle
    from autopar.passes.grad_sync import deferred_grad_axes
    from autopar.passes.trace import Role
    from autopar.placement import Outputs, local_shape

    tg, plan, choice = result.traced, result.plan, result.choice
    attrs = {}
    for p in tg.placeholders:
        if p.role is Role.INPUT:
            continue
        full = tg.state[p.target]
        shape = local_shape(tuple(full.shape), choice[p.name].out, plan.mesh_shape)
        t = torch.empty(shape, dtype=full.dtype, device="meta")
        attrs[mangle(p.target)] = torch.nn.Parameter(t) if p.role is Role.PARAM else t
    deferred = deferred_grad_axes(tg, choice, plan.mesh_shape)
    gm = lower(
        tg, choice, plan.mesh_shape, attrs, deferred, Outputs(plan.outputs), plan.overlap_matmuls,
        plan.float8_linears,
    )  # fmt: skip
    return gm.code


def _record(name, build, cluster, kw) -> dict:
    torch.manual_seed(0)
    model, inputs = build()
    try:
        result = search(model, cluster, inputs, **kw)
    except autopar.NoPlanFitsError as e:
        return {"error": str(e).split(";")[0]}
    plan = result.plan
    p = plan.predicted
    return {
        "mesh": list(plan.mesh_shape),
        "placements": {d.name: [d.output, *d.inputs] for d in plan.decisions},
        "node_seconds": {d.name: [d.compute_s, d.comm_s] for d in plan.decisions},
        "collectives": {d.name: [str(c) for c in d.collectives] for d in plan.decisions if d.collectives},
        "predicted": {
            "step_time_s": p.step_time_s,
            "peak_memory_bytes": p.peak_memory_bytes,
            "compute_s": p.compute_s,
            "comm_s": p.comm_s,
            "activation_bytes": p.activation_bytes,
            "grad_sync_hidden_s": p.grad_sync_hidden_s,
        },
        "code": _code(result),
    }


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def _compare(old: dict, new: dict) -> tuple[bool, str]:
    if "error" in old or "error" in new:
        same = old.get("error") == new.get("error")
        return same, f"error {'same' if same else 'differs'}: {new.get('error', 'a plan')!s:.80}"
    placements = old["placements"] == new["placements"] and old["mesh"] == new["mesh"]
    code = old["code"] == new["code"]
    worst = max(_rel(old["predicted"][k], new["predicted"][k]) for k in old["predicted"])
    for n, (c, m) in old["node_seconds"].items():
        c2, m2 = new["node_seconds"].get(n, (math.nan, math.nan))
        worst = max(worst, _rel(c, c2), _rel(m, m2))
    ok = placements and code and worst <= ARGS.rtol
    return ok, (
        f"placements {'same' if placements else 'DIFFER'}, code {'same' if code else 'DIFFERS'}, "
        f"largest figure change {worst:.2e}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", type=Path)
    g.add_argument("--compare", type=Path)
    ap.add_argument("--case", action="append", help="only cases whose name contains this (repeatable)")
    ap.add_argument("--rtol", type=float, default=1e-3)
    global ARGS
    ARGS = ap.parse_args()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads")
    failed = 0
    for name, build, cluster, kw in _cases():
        if ARGS.case and not any(c in name for c in ARGS.case):
            continue
        rec = _record(name, build, cluster, dict(kw))
        if ARGS.save:
            ARGS.save.mkdir(parents=True, exist_ok=True)
            (ARGS.save / f"{name}.json").write_text(json.dumps(rec, indent=1))
            what = (
                rec.get("error") or f"mesh {rec['mesh']} step {rec['predicted']['step_time_s'] * 1e3:.3f} ms"
            )
            print(f"{name:32s} saved: {what}", flush=True)
        else:
            path = ARGS.compare / f"{name}.json"
            if not path.exists():
                print(f"{name:32s} no saved record", flush=True)
                continue
            old = json.loads(path.read_text())
            rec = json.loads(json.dumps(rec))  # the same float round trip as the saved record
            ok, line = _compare(old, rec)
            failed += not ok
            print(f"{name:32s} {'ok  ' if ok else 'FAIL'} {line}", flush=True)
    if ARGS.compare:
        print(f"{failed} case(s) differ")
        sys.exit(1 if failed else 0)


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
