"""Plan replay (``passes/replay.py``): the module every rank generates is the same whether built
from the search's own result (rank 0 of ``autoparallelize``) or from the plan it sends the others.

``codegen/build.py:module_graph`` given the search's choice and graph, and given neither (the plan
replayed on the model: traced again, its decisions read back and checked), must give the same
graph, the same strategies in the same order and the same local arguments of a data-parallel
region's ops: plain plans, a plan over micro-batches (traced again on one micro-batch) and a plan
with a data-parallel region. No process group: what ``build_parallel_module`` then builds is a
function of these alone.
"""

from __future__ import annotations

import dataclasses

import pytest
from harness import D, T
from test_data_region import _routed

import autopar
from autopar.codegen.build import module_graph
from autopar.examples import gpt2_tiny, mlp
from autopar.passes.local_rows import LOCAL_CALL
from autopar.passes.replay import check_choice, decoded_choice, traced_as_planned
from autopar.placement import OwnRows, spec_from_str


def _cpu(world: int) -> autopar.ClusterSpec:
    return autopar.ClusterSpec.preset("cpu", devices_per_node=world)


CASES = {
    "mlp-tensor": (lambda: mlp(batch=16, hidden=64, ffn=128), 2, {"axis_roles": (T,)}),
    "gpt2-2x2": (lambda: gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128), 4, {"mesh_shape": (2, 2)}),
    "mlp-micro-batches": (
        lambda: mlp(batch=16, hidden=64, ffn=128),
        2,
        {"axis_roles": (D,), "micro_batches": 2},
    ),
    "routed-region": (_routed, 2, {"mesh_shape": (2,), "axis_roles": (D,)}),
}


def _local_calls(tg) -> dict[str, str]:
    return {n.name: str(n.meta[LOCAL_CALL]) for n in tg.graph.nodes if LOCAL_CALL in n.meta}


@pytest.mark.parametrize("case", list(CASES))
def test_the_searched_module_graph_is_the_replayed_one(case):
    build, world, kw = CASES[case]
    model, inputs = build()
    result = autopar.search(model, _cpu(world), inputs, **kw)
    # what the other ranks receive: the plan through its dict form
    plan = autopar.Plan.from_dict(result.plan.to_dict())
    searched = module_graph(model, inputs, plan, result.traced, result.choice)
    replayed = module_graph(model, inputs, plan, traced_as_planned(model, inputs, plan))
    assert list(searched.choice.items()) == list(replayed.choice.items())
    assert searched.traced.graph_module.code == replayed.traced.graph_module.code
    assert repr(searched.inputs) == repr(replayed.inputs)
    own = [n for n, s in searched.choice.items() if OwnRows.LOCAL in s.via]
    if case == "routed-region":
        assert own
    if case == "mlp-micro-batches":
        assert plan.trades.micro_batches == 2 and searched.traced is not result.traced
    local = _local_calls(searched.traced)
    assert {n: local[n] for n in own} == {n: _local_calls(replayed.traced)[n] for n in own}


def test_a_plan_its_micro_batches_do_not_fit_is_refused_alike_on_every_rank():
    """Built from the search's choice or from the plan, a plan whose placements do not split its
    micro-batches raises the same MicroBatchError."""
    from autopar.codegen.micro_batches import MicroBatchError

    model, inputs = mlp(batch=16, hidden=64, ffn=128)
    result = autopar.search(model, _cpu(2), inputs, axis_roles=(D,))
    plan = dataclasses.replace(result.plan, trades=dataclasses.replace(result.plan.trades, micro_batches=16))
    errors = []
    for tg, choice in ((result.traced, result.choice), (traced_as_planned(model, inputs, plan), None)):
        with pytest.raises(MicroBatchError) as e:
            module_graph(model, inputs, plan, tg, choice)
        errors.append(str(e.value))
    assert errors[0] == errors[1]


def test_check_choice_names_the_node_and_its_placements():
    model, inputs = mlp(batch=16, hidden=64, ffn=128)
    plan = autopar.plan(model, _cpu(2), inputs, axis_roles=(T,))
    tg = traced_as_planned(model, inputs, plan)
    choice = decoded_choice(plan)
    check_choice(tg, plan.mesh_shape, choice)  # the plan's own: allowed
    linear = choice["linear"]
    bad = dataclasses.replace(linear, out=spec_from_str("S(0)"))
    with pytest.raises(
        autopar.PlanFormatError, match=r"node linear \(aten\.linear\.default\): placement out=S\(0\)"
    ):
        check_choice(tg, plan.mesh_shape, {**choice, "linear": bad})
    with pytest.raises(autopar.PlanFormatError, match="no decision for nodes"):
        check_choice(tg, plan.mesh_shape, {k: v for k, v in choice.items() if k != "linear"})
