"""The gradient sync reads the graph's structure from one walk per search
(``passes/grad_sync.py:walked_once``): every solution a search prices gets the same uses and the
same prices as from a walk of its own, and the uses are those of the walk over the graph spelled
out node by node (as ``plan_uses`` walked it before)."""

from __future__ import annotations

import operator

import torch

import autopar
from autopar.examples import gpt2_tiny
from autopar.passes import grad_sync
from autopar.passes import price as price_module
from autopar.passes.costs import resolve_source
from autopar.passes.rules import tensor_inputs
from autopar.placement import output_placement


def _plan_uses_spelled_out(tg, choice, deferred, outputs):
    """``plan_uses`` as a walk over every node of the graph."""
    seen: set = set()
    deferred = grad_sync.deferred_sources(tg, choice, deferred)
    out = []

    def use(node, k, inp, src, need, fops):
        key = grad_sync.reshard_key(inp, choice[src].out, need, fops, node)
        out.append(grad_sync.Use(node, k, inp, src, need, fops, key is None or key not in seen))
        if key is not None:
            seen.add(key)

    for node in tg.graph.nodes:
        if node.op == "output":
            tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
            for k, inp in enumerate(tensors):
                src = resolve_source(inp).name
                if src in choice:
                    use(node, k, inp, src, output_placement(choice[src].out, outputs), ())
            continue
        if node.op != "call_function" or node.name not in choice or node.target is operator.getitem:
            continue
        s = choice[node.name]
        for k, inp in enumerate(tensor_inputs(node)):
            src = resolve_source(inp).name
            if src in choice:
                fops = grad_sync.emitted_f_axes(s, k, inp, deferred.get(src, ()))
                use(node, k, inp, src, s.ins[k], fops)
    return out


def test_one_walk_per_search_prices_every_solution_as_its_own_walk(monkeypatch):
    calls = []
    price = grad_sync.price_grad_sync

    def captured(tg, infos, choice, *a, **k):
        got = price(tg, infos, choice, *a, **k)
        assert grad_sync._kept_walk(tg) is not None  # the search's walk, read here
        calls.append((tg, infos, choice, a, k, got))
        return got

    monkeypatch.setattr(price_module, "price_grad_sync", captured)
    model, inputs = gpt2_tiny()
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=4)
    autopar.plan(model, cluster, inputs, micro_batches=2)
    assert len(calls) > 3
    assert any(c[5].deferred for c in calls)  # some plans defer gradients to buckets
    for tg, infos, choice, a, k, got in calls:
        assert grad_sync._kept_walk(tg) is None  # outside the search: walked anew
        assert price(tg, infos, choice, *a, **k) == got
        outputs = a[3] if len(a) > 3 else k.get("outputs", autopar.Outputs.FULL)
        deferred = grad_sync.deferred_grad_axes(tg, choice, a[1].mesh_shape)
        assert list(grad_sync.plan_uses(tg, choice, deferred, outputs)) == _plan_uses_spelled_out(
            tg, choice, deferred, outputs
        )
        with grad_sync.walked_once(tg):
            assert list(grad_sync.plan_uses(tg, choice, deferred, outputs)) == _plan_uses_spelled_out(
                tg, choice, deferred, outputs
            )
