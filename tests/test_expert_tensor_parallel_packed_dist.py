"""Expert tensor parallelism of packed gate-up weights trains as one device does (gloo, world 4).

Hugging Face's Mixtral and Qwen3-MoE keep gate and up as one ``gate_up_proj`` ``[E, 2I, H]``. On a
tensor axis its ``2I`` dim is split with each rank's piece a gate block and the matching up block:
the module stores the weight permuted (``autopar/lowerings/experts.py:PackedSplit``). Planned on a
2 x 2 mesh, an expert axis beside a tensor axis (both orders), on CPU ranks whose link is priced
free (``harness.free_link_cpu``). Each rank's losses of 2 Adam steps and the full state after them
equal the single-device model's (so the permuted order never leaks out of ``full_state_dict``);
then a second module of the same plan loads that full state and gives it back, and loads its own
sharded ``state_dict()`` in place, and its optimizer's state likewise; a ``DTensor`` of other
placements for a permuted weight (or its moments) is an error, never read in the wrong order.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from harness import T, adam_rank, adam_reference, assert_rank_as_reference, free_link_cpu, run_on_ranks

import autopar
from autopar.examples import moe_tiny
from autopar.placement import Shard, is_partial, spec_from_str

pytestmark = pytest.mark.slow

E = autopar.AxisRole.EXPERT
LR, EPS, STEPS = 1e-2, 1e-5, 2
MOE = "autopar.moe_experts.default"
WORLD = 4
CASES = [("mixtral", (2, 2), (E, T)), ("qwen3_moe", (2, 2), (T, E))]


def build(name):
    return moe_tiny(name, batch=4, seq=8)


def _key(name, mesh, roles):
    return (name, mesh, tuple(r.value for r in roles))


def _round_trip(pmodel, full: dict[str, torch.Tensor]) -> str:
    """ "" where ``pmodel`` loads ``full`` (whole tensors) and gives it back, loads its own
    ``state_dict()`` unchanged, and refuses a packed weight as a DTensor of other placements;
    else what failed."""
    from torch.distributed.tensor import DTensor, Replicate

    pmodel.load_state_dict(full)
    back = pmodel.full_state_dict()
    for k, v in full.items():
        if not torch.equal(back[k], v):
            return f"{k}: full_state_dict after load_state_dict differs"
    pmodel.load_state_dict(pmodel.state_dict())
    if any(not torch.equal(pmodel.full_state_dict()[k], v) for k, v in full.items()):
        return "loading the module's own state_dict() changed its state"
    packed = next(k for k in full if k.endswith("gate_up_proj"))
    own = pmodel.state_dict()[packed]
    other = DTensor.from_local(own.full_tensor(), own.device_mesh, [Replicate()] * own.device_mesh.ndim)
    try:
        pmodel.load_state_dict({**full, packed: other})
    except ValueError as e:
        if "kept permuted" not in str(e):
            return f"unexpected error: {e}"
    else:
        return "a packed weight as a DTensor of other placements was loaded"
    # the optimizer's moments of a permuted weight: its own state loads back, another layout's not
    opt = pmodel.optimizer(torch.optim.Adam, lr=LR)
    saved = pmodel.optimizer_state_dict(opt)
    pmodel.load_optimizer_state_dict(opt, saved)
    moment = saved["state"][packed]["exp_avg"]
    whole = DTensor.from_local(
        moment.full_tensor(), moment.device_mesh, [Replicate()] * moment.device_mesh.ndim
    )
    saved["state"][packed] = {**saved["state"][packed], "exp_avg": whole}
    try:
        pmodel.load_optimizer_state_dict(opt, saved)
    except ValueError as e:
        if "kept permuted" not in str(e):
            return f"unexpected optimizer error: {e}"
    else:
        return "a packed weight's moment in other placements was loaded"
    return ""


def _rank(rank, world, jobs):
    results = adam_rank(rank, world, build, jobs, STEPS, LR, EPS)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    for key, path in jobs:
        if isinstance(results[key], str):
            continue
        try:
            model, inputs = build(key[0])
            pmodel = autopar.autoparallelize(model, cluster, inputs, plan=path)
            results[key] = (*results[key], _round_trip(pmodel, results[key][1]))
        except Exception:  # noqa: BLE001 - reported by that configuration's test
            results[key] = traceback.format_exc()
    return results


_RUN: list = []


def _world(tmp_path_factory):
    """(key -> plan, per rank: key -> (losses, full state, code, axes, round-trip failure)), one spawn."""
    if not _RUN:
        tmp = tmp_path_factory.mktemp("etp_packed")
        plans, jobs = {}, []
        for i, (name, mesh, roles) in enumerate(CASES):
            model, inputs = build(name)
            plan = autopar.plan(model, free_link_cpu(WORLD), inputs, mesh_shape=mesh, axis_roles=roles)
            path = tmp / f"{i}_{name}.json"
            plan.save(path)
            plans[_key(name, mesh, roles)] = plan
            jobs.append((_key(name, mesh, roles), str(path)))
        _RUN.append((plans, run_on_ranks(_rank, WORLD, jobs, timeout_s=900)))
    return _RUN[0]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_packed_expert_tensor_parallel_trains_as_one_device(case, tmp_path_factory):
    name, mesh, roles = case
    plans, per_rank = _world(tmp_path_factory)
    plan = plans[_key(*case)]
    t = roles.index(T)
    moe = [d for d in plan.decisions if d.op == MOE]
    assert moe, "the MoE layers were not folded into one op"
    for d in moe:  # gate_up [E, 2I, H] split on 2I, down [E, H, I] on I: the output a summand
        assert spec_from_str(d.inputs[3])[t] == Shard(1), d
        assert spec_from_str(d.inputs[4])[t] == Shard(2), d
        assert is_partial(spec_from_str(d.output)[t]), d
    model, inputs = build(name)
    ref = adam_reference(model, inputs, STEPS, LR, EPS)
    for rank, results in enumerate(per_rank):
        res = results[_key(*case)]
        assert not isinstance(res, str), f"rank {rank} failed:\n{res}"
        assert_rank_as_reference(rank, res[:4], ref, LR, STEPS)
        assert res[4] == "", f"rank {rank}: {res[4]}"
