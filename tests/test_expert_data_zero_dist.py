"""ZeRO 1, 2 and 3 over two batch axes (expert parallelism beside data parallelism) train as one
device does (gloo, world 4).

A 2 x 2 mesh, axis 0 data parallel and axis 1 expert parallel: the batch split on both. ZeRO shards
each parameter's state over the data axes it is whole on (``passes/trades.py:zero_size``): ZeRO-1
(``codegen/zero_one.py``) the dense parameters over both axes (4 shares) and the experts, split on
the expert axis, over the data axis; ZeRO-2 and 3 by FSDP2 over both axes flattened into one shard
dimension (``codegen/zero.py``), the experts left out (their gradient reduced over the data axis as
without ZeRO). Each rank's losses of 2 Adam steps and the full state after them equal the
single-device model's.
"""

from __future__ import annotations

import pytest
from harness import D, adam_reference, assert_world_as_reference, plan_and_train

import autopar
from autopar.examples import moe_plain_tiny, moe_tiny
from autopar.placement import ExpertDispatch, R, Shard, spec_from_str, via_from_str

pytestmark = pytest.mark.slow

E = autopar.AxisRole.EXPERT
LR, EPS, STEPS = 1e-2, 1e-5, 2
MOE = "autopar.moe_experts.default"
WORLD, MESH, ROLES = 4, (2, 2), (D, E)
# (model, ZeRO stage)
CASES = [("plain", 1), ("plain", 3), ("qwen3_moe", 2)]


def build(name):
    if name == "plain":
        return moe_plain_tiny(batch=4, seq=8)
    return moe_tiny(name, batch=4, seq=8)


_RUN: list = []
_REFS: dict = {}


def _world(tmp_path_factory):
    if not _RUN:
        cases = {case: dict(mesh_shape=MESH, axis_roles=ROLES, zero_stage=case[1]) for case in CASES}
        cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=WORLD)
        tmp = tmp_path_factory.mktemp("epdp_zero")
        _RUN.append(plan_and_train(WORLD, build, cluster, cases, tmp, STEPS, LR, EPS))
    return _RUN[0]


def _reference(name):
    if name not in _REFS:
        model, inputs = build(name)
        _REFS[name] = adam_reference(model, inputs, STEPS, LR, EPS)
    return _REFS[name]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_zero_over_data_and_expert_axes_trains_as_one_device(case, tmp_path_factory):
    name, zero = case
    plans, per_rank = _world(tmp_path_factory)
    plan = plans[case]
    assert not isinstance(plan, str), f"planning failed:\n{plan}"
    moe = [x for x in plan.decisions if x.op == MOE]
    assert moe, "the MoE layers were not folded into one op"
    for x in moe:  # tokens split on both axes; experts split on the expert axis only, by all-to-all
        assert spec_from_str(x.inputs[0]) == (Shard(0), Shard(0)), x
        assert spec_from_str(x.inputs[3]) == (R, Shard(0)), x
        assert via_from_str(x.via)[1] is ExpertDispatch.ALL_TO_ALL, x
    assert int(plan.trades.zero_stage) == zero and plan.trades.data_axes == (0, 1), plan.trades
    assert_world_as_reference(per_rank, case, _reference(name), LR, STEPS, MESH, "expert_parallel")
