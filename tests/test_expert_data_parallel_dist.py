"""Expert parallelism beside data parallelism on separate mesh axes trains as one device does
(gloo, world 4).

A 2 x 2 mesh, one axis data parallel (every expert whole there) and the other expert parallel
(each MoE layer's experts split over it, the pairs sent to them by all-to-all within that axis's
group): the batch splits on both axes, nested as DTensor nests them (the lower axis outer:
``passes/strategies.py:nest_axes``, ``autopar/reshard.py``). In both axis orders on the plain-torch
MoE (one with 2 micro-batches, one with ZeRO-1 over both batch axes), and on Mixtral and Qwen3-MoE
(ZeRO-1). Each rank's losses of 2 Adam steps
and the full state after them equal the single-device model's.
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
WORLD = 4
# (model, mesh, roles, micro-batches, ZeRO stage: None the search's)
CASES = [
    ("plain", (2, 2), (D, E), None, None),
    ("plain8", (2, 2), (E, D), 2, None),
    ("plain", (2, 2), (D, E), None, 1),
    ("mixtral", (2, 2), (D, E), None, None),
    ("qwen3_moe", (2, 2), (E, D), None, 1),
]


def build(name):
    if name.startswith("plain"):  # plain8: 8 sequences, 2 micro-batches of 4 split 2 x 2
        return moe_plain_tiny(batch=8 if name == "plain8" else 4, seq=8)
    return moe_tiny(name, batch=4, seq=8)


_RUN: list = []


def _key(name, mesh, roles, micro, zero):
    return (name, mesh, tuple(r.value for r in roles), micro, zero)


def _world(tmp_path_factory):
    if not _RUN:
        cases = {}
        for case in CASES:
            name, mesh, roles, micro, zero = case
            more = {"micro_batches": micro} if micro else {}
            if zero is not None:
                more["zero_stage"] = zero
            cases[_key(*case)] = dict(mesh_shape=mesh, axis_roles=roles, **more)
        cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=WORLD)
        tmp = tmp_path_factory.mktemp("epdp")
        _RUN.append(plan_and_train(WORLD, build, cluster, cases, tmp, STEPS, LR, EPS))
    return _RUN[0]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_expert_and_data_parallel_on_separate_axes_train_as_one_device(case, tmp_path_factory):
    name, mesh, roles, micro, zero = case
    plans, per_rank = _world(tmp_path_factory)
    plan = plans[_key(*case)]
    assert not isinstance(plan, str), f"planning failed:\n{plan}"
    e, d = roles.index(E), roles.index(D)
    moe = [x for x in plan.decisions if x.op == MOE]
    assert moe, "the MoE layers were not folded into one op"
    for x in moe:  # tokens split on both axes; experts split on the expert axis only, by all-to-all
        assert spec_from_str(x.inputs[0]) == (Shard(0), Shard(0)), x
        assert spec_from_str(x.inputs[3])[e] == Shard(0) and spec_from_str(x.inputs[3])[d] == R, x
        assert via_from_str(x.via)[e] is ExpertDispatch.ALL_TO_ALL, x
    assert micro is None or plan.trades.micro_batches == micro
    if zero is not None:  # ZeRO-1 over both batch axes: the step's state sharded over them
        assert int(plan.trades.zero_stage) == zero and plan.trades.data_axes == (0, 1), plan.trades
    model, inputs = build(name)
    ref = adam_reference(model, inputs, STEPS, LR, EPS)
    assert_world_as_reference(per_rank, _key(*case), ref, LR, STEPS, mesh, "expert_parallel")
