"""Expert tensor parallelism trains as one device does (gloo, world 4).

On a tensor axis each expert's MLP is split on its intermediate dim (``passes/rules/experts.py``:
gate and up column-split, down row-split, the layer's output a summand), tokens whole there. The
plain-torch MoE (gate and up separate tensors) planned on a 2 x 2 mesh with that axis beside an
expert axis (EP x ETP, in both axis orders), on CPU ranks whose
link is priced free (``harness.free_link_cpu``: on loopback gloo's ~1 ms per collective the toy's
experts rightly stay whole there). Each rank's losses of 2 Adam steps and the full state after them
equal the single-device model's.
"""

from __future__ import annotations

import pytest
from harness import T, adam_reference, assert_world_as_reference, free_link_cpu, plan_and_train

import autopar
from autopar.examples import moe_plain_tiny
from autopar.placement import ExpertDispatch, is_partial, spec_from_str, via_from_str

pytestmark = pytest.mark.slow

E = autopar.AxisRole.EXPERT
LR, EPS, STEPS = 1e-2, 1e-5, 2
MOE = "autopar.moe_experts.default"
WORLD = 4
# (model, mesh, roles): the experts' intermediate dim split on the tensor axis
CASES = [("plain", (2, 2), (E, T)), ("plain", (2, 2), (T, E))]
# per expert weight (w_gate [E, H, F], w_up [E, H, F], w_down [E, F, H]): the dim ETP splits
ETP_DIMS = (2, 2, 1)


def build(name):
    assert name == "plain"
    return moe_plain_tiny(batch=4, seq=8)


_RUN: list = []


def _key(name, mesh, roles):
    return (name, mesh, tuple(r.value for r in roles))


def _world(tmp_path_factory):
    if not _RUN:
        cases = {_key(*case): dict(mesh_shape=case[1], axis_roles=case[2]) for case in CASES}
        tmp = tmp_path_factory.mktemp("etp")
        _RUN.append(plan_and_train(WORLD, build, free_link_cpu(WORLD), cases, tmp, STEPS, LR, EPS))
    return _RUN[0]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_expert_tensor_parallel_trains_as_one_device(case, tmp_path_factory):
    name, mesh, roles = case
    plans, per_rank = _world(tmp_path_factory)
    plan = plans[_key(*case)]
    assert not isinstance(plan, str), f"planning failed:\n{plan}"
    t = roles.index(T)
    moe = [d for d in plan.decisions if d.op == MOE]
    assert moe, "the MoE layers were not folded into one op"
    for d in moe:  # each expert's intermediate dim split on the tensor axis, the output a summand
        for i, dim in zip((3, 4, 5), ETP_DIMS):
            assert spec_from_str(d.inputs[i])[t] == autopar.placement.Shard(dim), d
        assert is_partial(spec_from_str(d.output)[t]), d
        assert via_from_str(d.via)[roles.index(E)] is ExpertDispatch.ALL_TO_ALL, d
    model, inputs = build(name)
    ref = adam_reference(model, inputs, STEPS, LR, EPS)
    assert_world_as_reference(per_rank, _key(*case), ref, LR, STEPS, mesh, "expert_parallel")
