"""The ILP's node limit (``passes/solver.py:MIP_NODE_LIMIT``): a count of branch-and-bound nodes,
not seconds. Where it stops an ILP, the search takes the best plan so far (or the first on the
ILP's rows alone) and the plan says what was not explored; where it stops none, the plan is the
one the search finds without it."""

from __future__ import annotations

import torch
from test_loop_coarsen import STEPS, Net

import autopar
from autopar.options import AxisRole
from autopar.passes import solver

CLUSTER = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
KW = dict(axis_roles=(AxisRole.AUTO,), optimizer=autopar.Optimizer.SGD)


def _model():
    torch.manual_seed(0)
    return Net(), (torch.randn(8, STEPS, 16),)


def _limit(model, inputs) -> float:
    free = autopar.plan(model, CLUSTER, inputs, **KW)
    return 0.7 * free.predicted.peak_memory_bytes / (1 - CLUSTER.memory_reserve)


def test_a_cut_search_says_what_it_did_not_explore(monkeypatch):
    model, inputs = _model()
    limit = _limit(model, inputs)
    whole = autopar.plan(model, CLUSTER, inputs, memory_limit_bytes=limit, **KW)
    assert not whole.solver.node_limited and "node limit" not in whole.summary()
    monkeypatch.setattr(solver, "MIP_NODE_LIMIT", 0)  # every ILP stops before its root
    cut = autopar.plan(model, CLUSTER, inputs, memory_limit_bytes=limit, **KW)
    assert cut.solver.status == "Feasible (node limit)"
    assert cut.predicted.peak_memory_bytes <= limit  # a plan of the ILP's rows: it fits
    assert cut.predicted.step_time_s >= whole.predicted.step_time_s * (1 - 1e-9)  # no better than the optimum
    stopped = cut.solver.node_limited
    assert stopped and all(c["status"] == "Feasible (node limit)" and "ilp_bound" in c for c in stopped)
    line = next(x for x in cut.summary().splitlines() if "node limit:" in x)
    assert f"mesh {tuple(stopped[0]['mesh_shape'])}" in line and "not explored" in line
    again = autopar.Plan.from_dict(cut.to_dict())  # the record survives the plan's file
    assert again.solver.node_limited == stopped and again.summary() == cut.summary()


def test_the_same_limit_gives_the_same_plan(monkeypatch):
    """A node limit counts work: a search cut by it plans the same in a second run."""
    model, inputs = _model()
    monkeypatch.setattr(solver, "MIP_NODE_LIMIT", 0)
    first = autopar.plan(model, CLUSTER, inputs, **KW)
    second = autopar.plan(model, CLUSTER, inputs, **KW)
    assert first.solver.node_limited
    assert first.decisions_fingerprint() == second.decisions_fingerprint()
    assert first.solver.candidates == second.solver.candidates  # where each stopped, and its bound
