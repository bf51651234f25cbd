"""Under ZeRO 2 and 3 the generated forward reads FSDP2's gathered parameters through plain
leaves (``codegen/zero.py:_gathered_leaves``): on 2 data-parallel ranks the losses, gradients and
weights of Adam steps are bit for bit those of the ``to_local`` path (``local_leaves = False``),
whose gradients ``test_zero`` checks against one device; with leaves, backward runs no
``to_local`` node."""

from __future__ import annotations

import pytest
import torch
from harness import free_link_cpu

import autopar
from autopar.examples import gpt2_tiny
from autopar.launch import run_on_ranks
from autopar.passes.strategies import AxisRole

STEPS = 2


def _build():
    return gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128)


def _to_local_nodes(loss: torch.Tensor) -> int:
    """How many ``to_local`` backward nodes the autograd graph of ``loss`` holds."""
    seen, todo, n = set(), [loss.grad_fn], 0
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        n += "ToTorchTensor" in type(fn).__name__
        todo.extend(f for f, _ in fn.next_functions)
    return n


def _rank(rank, world, plan_path):
    out = {}
    for leaves in (False, True):
        model, inputs = _build()
        pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=plan_path)
        pmodel.local_leaves = leaves
        opt = pmodel.optimizer(torch.optim.Adam, lr=1e-2)
        losses, nodes = [], []
        for _ in range(STEPS):
            loss = pmodel(**inputs).loss
            nodes.append(_to_local_nodes(loss))
            loss.backward()
            losses.append(float(loss.detach()))
            grads = {k: v.clone() for k, v in pmodel.full_grads().items()}
            opt.step()
            opt.zero_grad()
        out[leaves] = (losses, nodes, grads, {k: v.clone() for k, v in pmodel.full_state_dict().items()})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_gathered_leaves_match_the_to_local_path(tmp_path, stage):
    model, inputs = _build()
    plan = autopar.plan(
        model, free_link_cpu(2), inputs, mesh_shape=(2,), axis_roles=(AxisRole.DATA,), zero_stage=stage
    )
    assert int(plan.trades.zero_stage) == stage
    path = tmp_path / "zero.json"
    plan.save(path)
    for got in run_on_ranks(_rank, 2, str(path)):
        (l0, n0, g0, w0), (l1, n1, g1, w1) = got[False], got[True]
        assert min(n0) > 0, "the to_local path reads parameters through to_local"
        assert n1 == [0] * STEPS, "with leaves no to_local node is left"
        assert l0 == l1
        assert g0.keys() == g1.keys() and g0
        for k in g0:
            assert torch.equal(g0[k], g1[k]), k
        for k in w0:
            assert torch.equal(w0[k], w1[k]), k
