"""autopar.reprice: a plan's decisions priced on another cluster, without a search."""

from __future__ import annotations

import pytest

import autopar
from autopar.examples import gpt2_tiny, mlp


@pytest.mark.parametrize(
    "build,mesh,roles",
    [
        (lambda: mlp(batch=16, hidden=64, ffn=128), (2,), (autopar.AxisRole.TENSOR,)),
        (lambda: gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128), (2, 2), None),
    ],
)
def test_repricing_a_plan_on_its_own_cluster_gives_its_own_prediction(build, mesh, roles):
    """The search prices its plan over coarsened, folded tables; repricing builds them plain, per
    node: the same step time and peak memory, to rounding."""
    model, inputs = build()
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=4 if len(mesh) == 2 else 2)
    plan = autopar.plan(
        model, cluster, inputs, mesh_shape=mesh, axis_roles=roles, optimizer=autopar.Optimizer.SGD
    )
    again = autopar.reprice(model, cluster, inputs, plan, optimizer=autopar.Optimizer.SGD)
    assert again.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert again.predicted.peak_memory_bytes == plan.predicted.peak_memory_bytes
    assert [(d.name, d.output, d.inputs) for d in again.decisions] == [
        (d.name, d.output, d.inputs) for d in plan.decisions
    ]
    assert again.solver.status == "Repriced"


def test_a_slower_link_costs_the_same_plan_more_communication_and_the_same_compute():
    model, inputs = mlp(batch=16, hidden=64, ffn=128)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    plan = autopar.plan(model, cluster, inputs, axis_roles=(autopar.AxisRole.TENSOR,))
    link = cluster.intra_node
    slow = cluster.with_overrides(intra_node=autopar.LinkSpec(link.bandwidth / 4, link.latency * 4))
    there = autopar.reprice(model, slow, inputs, plan)
    assert there.predicted.compute_s == pytest.approx(plan.predicted.compute_s, rel=1e-9)
    assert there.predicted.comm_s > 3.9 * plan.predicted.comm_s > 0
    with pytest.raises(autopar.PlanMismatchError):
        autopar.reprice(model, autopar.ClusterSpec.preset("cpu", devices_per_node=4), inputs, plan)
