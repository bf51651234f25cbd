"""The same decisions mean the same plan (``Plan.decision_parts``, ``codegen/agree.py:agree_on_plan``).

A plan's decisions (placements, collectives, mesh, trades, pipeline, kernels, outputs) are what
the ranks must share; its search's seconds and predicted figures are not. The search itself
depends on no clock: the same model, cluster and options give the same decisions under a clock
that runs a thousand times faster (as under heavy load), and a solver time limit, the one thing
that can make a plan depend on time, is recorded in the plan and named by its summary. On 2 gloo
ranks, a plan each rank searched itself builds the module the rank-0 search builds, and trains as
it does.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import torch

import autopar
from autopar.examples import gpt2_tiny
from autopar.launch import run_on_ranks


def _tiny():
    model, _ = gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128)  # seeded: the same weights each time
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


CLUSTER = autopar.ClusterSpec.preset("cpu", devices_per_node=2)


class _RacingClock:
    """A clock that moves on 1000 s at each read: every interval the search measures is huge."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1000.0
        return self.now


def test_decisions_do_not_depend_on_the_clock(monkeypatch):
    model, inputs = _tiny()
    first = autopar.plan(model, CLUSTER, inputs)
    clock = _RacingClock()
    fake = types.SimpleNamespace(perf_counter=clock, monotonic=clock, time=clock)
    patched = []
    for name, mod in list(sys.modules.items()):
        if (
            name.startswith(("autopar.passes", "autopar.codegen", "autopar.cost_model"))
            and getattr(mod, "time", None) is sys.modules["time"]
        ):
            monkeypatch.setattr(mod, "time", fake)
            patched.append(name)
    assert "autopar.passes.solver" in patched  # the solver's clock is the one replaced
    model, inputs = _tiny()
    second = autopar.plan(model, CLUSTER, inputs)
    # the solver's seconds differ (the racing clock's are thousands), the decisions do not
    assert second.solver.solve_time_s >= 1000.0 > first.solver.solve_time_s
    assert first != second
    assert first.decision_differences(second) == []
    assert first.decisions_fingerprint() == second.decisions_fingerprint()
    assert first.decision_parts() == second.decision_parts()


def test_decision_parts_leave_out_what_was_measured():
    model, inputs = _tiny()
    plan = autopar.plan(model, CLUSTER, inputs)
    measured = dataclasses.replace(
        plan,
        solver=dataclasses.replace(
            plan.solver, solve_time_s=99.0, status="Feasible (time limit)", objective=1.0
        ),
        predicted=dataclasses.replace(plan.predicted, step_time_s=1.0),
        decisions=tuple(dataclasses.replace(d, compute_s=d.compute_s + 1.0) for d in plan.decisions),
    )
    assert measured.decisions_fingerprint() == plan.decisions_fingerprint()
    other = autopar.Plan.from_dict({**plan.to_dict(), "outputs": "local"})
    assert other.decisions_fingerprint() != plan.decisions_fingerprint()
    assert plan.decision_differences(other) == ["outputs"]
    node = plan.decisions[0]
    whole, split = ",".join(["R"] * len(plan.mesh_shape)), ",".join(["S(0)"] * len(plan.mesh_shape))
    moved = dataclasses.replace(
        plan,
        decisions=(
            dataclasses.replace(node, output=split if node.output == whole else whole),
            *plan.decisions[1:],
        ),
    )
    assert plan.decision_differences(moved) == [f"node {node.name}"]


def test_a_time_limit_is_recorded_and_named():
    model, inputs = _tiny()
    free = autopar.plan(model, CLUSTER, inputs)
    assert free.solver.time_limit_s is None and "time limit" not in free.summary()
    limited = autopar.plan(model, CLUSTER, inputs, time_limit_s=30.0)
    assert limited.solver.time_limit_s == 30.0
    assert "time limit: 30 s per mesh" in limited.summary()
    again = autopar.Plan.from_dict(limited.to_dict())
    assert again.solver.time_limit_s == 30.0 and again.summary() == limited.summary()


def _train(pmodel, inputs, steps=2) -> list[float]:
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = pmodel(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _per_rank_plans(rank, world):
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    model, inputs = _tiny()
    own = autopar.plan(model, cluster, inputs)  # each rank searches itself: the README's recipe
    pmodel = autopar.autoparallelize(model, cluster, inputs, plan=own)
    mine = _train(pmodel, inputs)
    model, inputs = _tiny()
    searched = autopar.autoparallelize(model, cluster, inputs)  # rank 0 searches, sends its plan
    theirs = _train(searched, inputs)
    return {
        "own": own.decisions_fingerprint(),
        "searched": searched.plan.decisions_fingerprint(),
        "differences": own.decision_differences(searched.plan),
        "losses": (mine, theirs),
    }


def test_each_rank_plans_itself():
    model, inputs = _tiny()
    with torch.no_grad():
        reference = float(model(**inputs).loss)
    results = run_on_ranks(_per_rank_plans, 2, timeout_s=600)
    for r in results:
        assert r["differences"] == [] and r["own"] == r["searched"]
        mine, theirs = r["losses"]
        assert mine == theirs  # the same module, trained the same
        torch.testing.assert_close(mine[0], reference, rtol=1e-5, atol=1e-6)
        assert mine[1] < mine[0]  # it trains
    assert results[0]["own"] == results[1]["own"]
