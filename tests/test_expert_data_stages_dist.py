"""Expert parallelism beside data parallelism inside pipeline stages trains as one device does
(gloo, world 4).

Two pipeline stages, each on a stage mesh whose roles are (DATA, EXPERT): the batch split on both
axes, the experts whole on the data axis and split on the expert axis by all-to-all
(``passes/candidates.py:stage_runs`` offers these meshes to the search). Four ranks fit two
stages of two: the (1, 2) stage mesh, the data axis of one rank (the roles ask nothing of it), the
expert axis of two. Two stages of (2, 2), both batch axes of two ranks, need 8 ranks, more than a
test here may spawn; the same code trains them as one device (checked by hand on 8 gloo ranks,
ZeRO-1 over both axes on the plain MoE, none on Qwen3-MoE; and 2 stages of (1, 2, 2) data x expert
x tensor on Qwen3-MoE, an SPMD (2, 2, 2) of those roles with ZeRO-1 on the plain MoE), and
``tests/test_expert_data_zero_dist.py`` covers gradients and ZeRO over two batch axes on SPMD
meshes. The plain-torch MoE (the search's trades) and Qwen3-MoE (ZeRO-1). Each rank's losses of 2
Adam steps and the full state after them equal the single-device model's.
"""

from __future__ import annotations

import pytest
from harness import D, adam_reference, assert_world_as_reference, plan_and_train

import autopar
from autopar.examples import moe_plain_tiny, moe_tiny
from autopar.placement import ExpertDispatch, Shard, spec_from_str, via_from_str

pytestmark = pytest.mark.slow

E = autopar.AxisRole.EXPERT
LR, EPS, STEPS = 1e-2, 1e-5, 2
MOE = "autopar.moe_experts.default"
WORLD, STAGES = 4, 2
# (model, stage mesh, ZeRO stage: None the search's)
CASES = [
    ("plain", (1, 2), None),
    ("qwen3_moe", (1, 2), 1),
]


def build(name):
    if name == "plain":
        return moe_plain_tiny(batch=4, seq=8)
    return moe_tiny(name, batch=4, seq=8)


_RUN: list = []
_REFS: dict = {}


def _world(tmp_path_factory):
    if not _RUN:
        cases = {}
        for case in CASES:
            name, mesh, zero = case
            more = {"zero_stage": zero} if zero is not None else {}
            cases[case] = dict(
                mesh_shape=mesh, axis_roles=(D, E), pipeline_stages=STAGES, micro_batches=2, **more
            )
        cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=WORLD)
        tmp = tmp_path_factory.mktemp("epdp_stages")
        _RUN.append(plan_and_train(WORLD, build, cluster, cases, tmp, STEPS, LR, EPS))
    return _RUN[0]


def _reference(name):
    if name not in _REFS:
        model, inputs = build(name)
        _REFS[name] = adam_reference(model, inputs, STEPS, LR, EPS)
    return _REFS[name]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_expert_beside_data_inside_stages_trains_as_one_device(case, tmp_path_factory):
    name, mesh, zero = case
    plans, per_rank = _world(tmp_path_factory)
    plan = plans[case]
    assert not isinstance(plan, str), f"planning failed:\n{plan}"
    assert plan.pipeline.stages == STAGES and tuple(plan.mesh_shape) == mesh
    moe = [x for x in plan.decisions if x.op == MOE]
    assert moe, "the MoE layers were not folded into one op"
    for x in moe:  # tokens split on both axes; experts split on the expert axis by all-to-all
        assert spec_from_str(x.inputs[0])[1] == Shard(0), x
        assert spec_from_str(x.inputs[3])[1] == Shard(0), x
        assert via_from_str(x.via)[1] is ExpertDispatch.ALL_TO_ALL, x
    if zero is not None:
        assert int(plan.trades.zero_stage) == zero, plan.trades
    assert_world_as_reference(per_rank, case, _reference(name), LR, STEPS, mesh, "expert_parallel")
