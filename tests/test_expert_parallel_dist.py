"""Expert parallelism trains as one device does (gloo, world 2 and 4).

Every mixture-of-experts family (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE, DeepSeek-V3
with MLA attention and grouped routing, and the plain-torch model of ``autopar/models/moe.py``) is
planned with an ``AxisRole.EXPERT`` axis: each MoE layer's experts split over it and its tokens
sent to them by all-to-all (``codegen/experts.py``). Layouts: expert parallel alone (2 and 4
ranks), with ZeRO-1, 2 and 3 over the expert axis (the dense parameters sharded, the experts
left out: they are split already), expert x tensor parallel on 2 x 2, and expert parallel inside
two pipeline stages. Each
rank's losses of 2 Adam steps and the full state after them equal the single-device model's.
"""

from __future__ import annotations

import pytest
from harness import T, adam_reference, assert_world_as_reference, plan_and_train

import autopar
from autopar.examples import MOE_FAMILIES, moe_plain_tiny, moe_tiny
from autopar.placement import ExpertDispatch, is_shard, spec_from_str, via_from_str

pytestmark = pytest.mark.slow

E = autopar.AxisRole.EXPERT
LR, EPS, STEPS = 1e-2, 1e-5, 2
MOE = "autopar.moe_experts.default"


def build(name):
    if name == "plain":
        return moe_plain_tiny(batch=4, seq=8)
    return moe_tiny(name, batch=4, seq=8)


# (model, mesh, roles, pipeline stages, ZeRO stage: None the search's)
CASES = {
    2: [(name, (2,), (E,), 1, None) for name in (*MOE_FAMILIES, "plain")]
    + [("qwen3_moe", (2,), (E,), 1, 3), ("plain", (2,), (E,), 1, 1)],
    4: [
        ("qwen3_moe", (4,), (E,), 1, None),
        ("plain", (4,), (E,), 1, 2),
        ("mixtral", (2, 2), (E, T), 1, None),
        ("plain", (2, 2), (T, E), 1, None),
        ("qwen2_moe", (2,), (E,), 2, None),
    ],
}


_RUNS: dict[int, tuple[dict, list]] = {}
_REFS: dict[str, tuple] = {}


def _key(name, mesh, roles, stages, zero):
    return (name, mesh, tuple(r.value for r in roles), stages, zero)


def _world(world: int, tmp_path_factory):
    if world not in _RUNS:
        cases = {}
        for case in CASES[world]:
            name, mesh, roles, stages, zero = case
            more = {"pipeline_stages": stages, "micro_batches": 2} if stages > 1 else {}
            if zero is not None:
                more["zero_stage"] = zero
            cases[_key(*case)] = dict(mesh_shape=mesh, axis_roles=roles, **more)
        cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
        tmp = tmp_path_factory.mktemp(f"experts{world}")
        _RUNS[world] = plan_and_train(world, build, cluster, cases, tmp, STEPS, LR, EPS)
    return _RUNS[world]


def _reference(name):
    if name not in _REFS:
        model, inputs = build(name)
        _REFS[name] = adam_reference(model, inputs, STEPS, LR, EPS)
    return _REFS[name]


@pytest.mark.parametrize("world,case", [(w, c) for w, cases in CASES.items() for c in cases], ids=str)
def test_expert_parallel_trains_as_one_device(world, case, tmp_path_factory):
    name, mesh, roles, stages, zero = case
    plans, per_rank = _world(world, tmp_path_factory)
    plan = plans[_key(*case)]
    assert not isinstance(plan, str), f"planning failed:\n{plan}"
    a = roles.index(E)
    moe = [d for d in plan.decisions if d.op == MOE]
    assert moe, "the MoE layers were not folded into one op"
    for d in moe:  # experts split on the expert axis, their tokens sent by all-to-all
        assert is_shard(spec_from_str(d.inputs[3])[a]), d
        assert via_from_str(d.via)[a] is ExpertDispatch.ALL_TO_ALL, d
    assert plan.pipeline.stages == stages
    if zero is not None:  # ZeRO over the expert axis: the dense parameters' state, the experts left out
        assert int(plan.trades.zero_stage) == zero and a in plan.trades.data_axes, plan.trades
    ref = _reference(name)
    assert_world_as_reference(per_rank, _key(*case), ref, LR, STEPS, mesh, "expert_parallel")
