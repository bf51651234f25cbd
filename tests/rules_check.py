"""What the rule property tests share (``test_rules_property.py`` for autopar's own rules,
``test_dtensor_rules.py`` for options derived from DTensor): the hypothesis settings, seeded
random values, and the check that every strategy of an op divides evenly and computes the dense op
(``autopar.tools.validate``, all ranks simulated in one process through the real lowering)."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings
from torch.distributed.tensor.placement_types import Shard

from autopar.tools.validate import check_node, node_strategies, one_node_graph, strategy_str

SETTINGS = settings(
    max_examples=int(os.environ.get("AUTOPAR_HYPOTHESIS_EXAMPLES", "20")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def randn(shape, seed=0, positive=False):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return x.abs() + 0.5 if positive else x


def even(shape, spec, mesh) -> bool:
    """Does ``spec`` cut ``shape`` into equal pieces on ``mesh``, no dim cut twice?"""
    seen = set()
    for p, n in zip(spec, mesh):
        if isinstance(p, Shard):
            d = p.dim % len(shape)
            if d in seen or shape[d] % n or shape[d] < n:
                return False
            seen.add(d)
    return True


def assert_rules_hold(target, args, kwargs, mesh, *, backward=True):
    """All strategies of ``target(*args, **kwargs)`` on ``mesh`` divide evenly and are correct;
    returns them."""
    node, values = one_node_graph(target, args, kwargs)
    strategies = node_strategies(node, mesh)
    assert strategies, "all-Replicate is always a strategy"
    out_shapes = [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(node.meta["val"])]
    for s in strategies:
        for v, spec in zip(values, s.ins):
            assert even(tuple(v.shape), spec, mesh), f"uneven input sharding {strategy_str(s)}"
        for shape in out_shapes:
            assert even(shape, s.out, mesh), f"uneven output sharding {strategy_str(s)}"
    results = check_node(node, mesh, values, strategies, backward=backward)
    bad = [str(r) for r in results if not r.ok]
    shapes_txt = [tuple(v.shape) for v in values]
    assert not bad, f"{target} inputs {shapes_txt} mesh {mesh}:\n" + "\n".join(bad)
    return strategies
