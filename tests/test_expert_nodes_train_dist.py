"""Expert parallelism dispatched once per node trains as one device does (gloo, world 4 as 2
"nodes" of 2 ranks).

The cluster: ``cpu`` ranks, 2 nodes of 2, with a fast link inside a node and a slow one between
(bytes, not latency, dominate: the search's price of sending a token once per node, ``ExpertDispatch.NODE_ALL_TO_ALL``,
is below the flat all-to-all's). Planned with an expert axis over all 4 ranks (2 per node), and
with an expert axis across the nodes beside a tensor axis inside them (1 per node: the rail is the
whole axis). The plan dispatches once per node, the generated code calls
``expert_parallel_nodes``, and each rank's losses of 2 Adam steps and the full state after them
equal the single-device model's (``harness.assert_world_as_reference``).
"""

from __future__ import annotations

import pytest
from harness import adam_reference, assert_world_as_reference, plan_and_train

import autopar
from autopar.cluster import LinkSpec
from autopar.examples import moe_plain_tiny, moe_tiny
from autopar.placement import ExpertDispatch, via_from_str

pytestmark = pytest.mark.slow

E, T = autopar.AxisRole.EXPERT, autopar.AxisRole.TENSOR
LR, EPS, STEPS, WORLD = 1e-2, 1e-5, 2, 4
MOE = "autopar.moe_experts.default"
CASES = [("plain", (4,), (E,)), ("mixtral", (2, 2), (E, T))]


def build(name):
    return moe_plain_tiny(batch=4, seq=8) if name == "plain" else moe_tiny(name, batch=4, seq=8)


def _cluster():
    return autopar.ClusterSpec.preset("cpu", nodes=2, devices_per_node=2).with_overrides(
        intra_node=LinkSpec(bandwidth=1e12, latency=1e-7), inter_node=LinkSpec(bandwidth=1e6, latency=1e-6)
    )


_RUNS: list = []


def _runs(tmp_path_factory):
    if not _RUNS:
        cases = {case: dict(mesh_shape=case[1], axis_roles=case[2], pipeline_stages=1) for case in CASES}
        tmp = tmp_path_factory.mktemp("expert_nodes")
        _RUNS.append(plan_and_train(WORLD, build, _cluster(), cases, tmp, STEPS, LR, EPS))
    return _RUNS[0]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_dispatch_once_per_node_trains_as_one_device(case, tmp_path_factory):
    plans, per_rank = _runs(tmp_path_factory)
    plan = plans[case]
    assert not isinstance(plan, str), f"planning failed:\n{plan}"
    a = case[2].index(E)
    moe = [d for d in plan.decisions if d.op == MOE]
    assert moe and all(via_from_str(d.via)[a] is ExpertDispatch.NODE_ALL_TO_ALL for d in moe), plan.summary()
    model, inputs = build(case[0])
    ref = adam_reference(model, inputs, STEPS, LR, EPS)
    assert_world_as_reference(per_rank, case, ref, LR, STEPS, case[1], "expert_parallel_nodes")
