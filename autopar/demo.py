"""``autopar demo``: plan a small GPT-2 for 4 CPU processes, run it on gloo, compare, report.

Steps: build the model -> plan (offline, as on a laptop) -> save plan.json -> run the plan on N
local gloo processes (SGD training steps, the same full batch on every rank) -> check the loss
against the single-device model -> measure step time and peak tensor memory per rank -> write
report.html with predicted and measured figures.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.launch import run_on_ranks
from autopar.model_spec import load_model_spec
from autopar.report import write_report
from autopar.tools.measure import least_peak_step_memory, time_steps

# big enough that splitting it pays for gloo's ~1 ms per collective on the cpu preset: on a
# smaller GPT-2 every rank computing the whole step, with no collective at all, is the best plan
DEMO_MODEL = "autopar.examples:gpt2_tiny(batch=16, seq=64, hidden=128)"


def train_step(model, opt, inputs):
    """One SGD step with the model's own loss (``.loss`` or the first output); returns the loss.
    A parallel module whose plan runs micro-batches takes the global batch through ``step``
    (forward and backward of each micro-batch, ``codegen/module.py``)."""
    if getattr(model, "micro_batches", 1) > 1:
        loss = model.step(**inputs) if isinstance(inputs, dict) else model.step(*inputs)
        opt.step()
        opt.zero_grad()
        return loss.detach()
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    loss = out.loss if hasattr(out, "loss") else out[0]
    loss.backward()
    opt.step()
    opt.zero_grad()  # set_to_none: the next backward allocates fresh gradients (and overlaps their reduction)
    return loss.detach()


def _rank_main(
    rank: int, world: int, model_spec: str, cluster_dict: dict, plan_path: str, steps: int
) -> dict:
    torch.manual_seed(0)
    model, inputs = load_model_spec(model_spec)
    cluster = autopar.ClusterSpec.from_dict(cluster_dict)
    pmodel = autopar.autoparallelize(model, cluster, inputs, plan=plan_path)
    opt = pmodel.optimizer(torch.optim.SGD, lr=0.05)  # the optimizer the plan's ZeRO stage needs
    losses = [float(train_step(pmodel, opt, inputs)) for _ in range(steps)]
    step_s = time_steps(lambda: train_step(pmodel, opt, inputs), warmup=1, repeat=5, barrier=dist.barrier)
    peak = least_peak_step_memory(pmodel, lambda: train_step(pmodel, opt, inputs), barrier=dist.barrier)
    return {
        "losses": losses,
        "step_time_s": step_s,
        "peak_memory_bytes": peak,
        "code": pmodel.code if rank == 0 else "",
    }


def _reference_losses(model_spec: str, steps: int) -> list[float]:
    torch.manual_seed(0)
    model, inputs = load_model_spec(model_spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return [float(train_step(model, opt, inputs)) for _ in range(steps)]


def run_demo(
    out_dir: str | Path = "autopar_out",
    model_spec: str = DEMO_MODEL,
    world_size: int = 4,
    steps: int = 3,
    cluster: autopar.ClusterSpec | None = None,
    mesh_shape: tuple[int, ...] | None = None,
) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    given = cluster is not None
    cluster = cluster or autopar.ClusterSpec.preset("cpu", devices_per_node=world_size)
    print(f"[1/4] planning {model_spec} for {cluster.world_size} x {cluster.device.name} ({cluster.name})")
    model, inputs = load_model_spec(model_spec)
    plan = autopar.plan(
        model,
        cluster,
        inputs,
        optimizer=autopar.Optimizer.SGD,
        mesh_shape=mesh_shape,
        progress=lambda m: print("      " + m),
    )
    plan_path = out / "plan.json"
    plan.save(plan_path)
    print(plan.summary(max_rows=12))
    print(f"      wrote {plan_path}")

    print(f"[2/4] running the plan on {world_size} local gloo processes ({steps} SGD steps + timing)")
    t0 = time.perf_counter()
    results = run_on_ranks(_rank_main, world_size, model_spec, cluster.to_dict(), str(plan_path), steps)
    print(f"      done in {time.perf_counter() - t0:.1f} s")
    (out / "rank0_code.py").write_text(results[0]["code"])

    print("[3/4] comparing with the single-device model")
    ref = _reference_losses(model_spec, steps)
    diff = max(abs(a - b) for r in results for a, b in zip(r["losses"], ref))
    print(f"      losses (parallel, rank 0): {[round(x, 6) for x in results[0]['losses']]}")
    print(f"      losses (single device):    {[round(x, 6) for x in ref]}")
    print(f"      max |difference| = {diff:.2e}  ({'OK' if diff < 1e-4 else 'MISMATCH'})")

    measured = {
        "step_time_s": max(r["step_time_s"] for r in results),
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in results),
        "world_size": world_size,
        "max_loss_difference": diff,
    }
    p = plan.predicted
    print("[4/4] predicted vs measured (per device, max over ranks)")
    print(
        f"      step time    predicted {p.step_time_s * 1e3:9.3f} ms   measured {measured['step_time_s'] * 1e3:9.3f} ms"
    )
    print(
        f"      peak memory  predicted {p.peak_memory_bytes / 2**20:9.3f} MiB  "
        f"measured {measured['peak_memory_bytes'] / 2**20:9.3f} MiB"
    )
    if not given:
        print(
            "      (priced with the cpu preset's figures, not this machine's: `autopar calibrate "
            f"--world-size {world_size} --out cluster.json`, then `autopar demo --cluster cluster.json`)"
        )
    report = write_report(plan, out / "report.html", measured=measured, title=f"autopar demo: {model_spec}")
    print(f"      wrote {report} and {out / 'rank0_code.py'} (the generated rank-local code)")
    if diff >= 1e-4:
        raise SystemExit("the parallel run does not match the single-device model")
    return {"plan": plan, "measured": measured, "reference": ref, "results": results}
