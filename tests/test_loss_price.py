"""A data-parallel loss's sums are priced as the runtime runs them: off the step's path
(``LoweringCall.deferred``, ``passes/use_price.py:deferred_output``). The generated forward
neither runs nor waits for them (``codegen/module.py:defer_output_sums``; the sum rides in
backward's first gradient bucket, ``tests/test_loss_rides.py``). Against the same plans priced
with the sums blocking, as before: the step is cheaper by at least one all-reduce of the comm
model's, and the records still list the all-reduce."""

from __future__ import annotations

import pytest

import autopar
from autopar.cost_model.comm import CommModel
from autopar.examples import gpt2_tiny, mlp
from autopar.lowerings import Collective, LoweringCall, Phase, price_calls
from autopar.plan import Site

D = autopar.AxisRole.DATA
CPU2 = autopar.ClusterSpec.preset("cpu", devices_per_node=2)


def test_a_deferred_call_costs_nothing():
    calls = [
        LoweringCall(Collective.ALL_REDUCE, 0, 8, Phase.FORWARD, deferred=True),
        LoweringCall(Collective.ALL_REDUCE, 0, 8, Phase.FORWARD),
    ]
    assert [t for _, t in price_calls(calls, lambda c: 1e-3, 0.0)] == [0.0, 1e-3]
    with pytest.raises(ValueError, match="deferred"):
        LoweringCall(Collective.ALL_REDUCE, 0, 8, Phase.FORWARD, window=0, hides=0.5, deferred=True)


def _plan(build):
    model, inputs = build()
    return autopar.search(model, CPU2, inputs, mesh_shape=(2,), axis_roles=(D,), zero_stage=0).plan


def _blocking(monkeypatch):
    """Price the loss's sums as blocking, as the cost model did before the deferral."""
    import autopar.lowerings.loss as loss
    import autopar.passes.costs as costs
    import autopar.passes.price as price

    monkeypatch.setattr(costs, "deferred_output", lambda calls: False)
    monkeypatch.setattr(price, "deferred_output", lambda calls: False)
    monkeypatch.setattr(loss, "returned_alone", lambda node, rows: False)


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_the_loss_sums_are_off_the_step_path(monkeypatch, name):
    build = {"mlp": lambda: mlp(batch=8, hidden=16, ffn=32), "gpt2": lambda: gpt2_tiny(batch=4, seq=16)}[name]
    deferred = _plan(build)
    _blocking(monkeypatch)
    blocking = _plan(build)
    assert [d.output for d in deferred.decisions] == [d.output for d in blocking.decisions]
    one = CommModel(CPU2, (2,)).time(Collective.ALL_REDUCE, 4, 0)  # the smallest loss's: a scalar
    assert blocking.predicted.step_time_s - deferred.predicted.step_time_s >= one * (1 - 1e-9)
    if name == "gpt2":  # the token mean's [sum, count] all-reduce: still listed, priced at nothing
        ce = [d for d in deferred.decisions if "cross_entropy" in d.op]
        assert len(ce) == 1
        inside = [c for c in ce[0].collectives if c.site is Site.INSIDE]
        assert [c.kind for c in inside] == [Collective.ALL_REDUCE]
        assert ce[0].comm_s == 0.0
        (was,) = [d for d in blocking.decisions if "cross_entropy" in d.op]
        assert was.comm_s >= one * (1 - 1e-9)
