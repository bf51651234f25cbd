"""The generated forward computes on plain leaves sharing the DTensor parameters' storage
(``codegen/local_params.py``): on 2 data-parallel ranks, the gradients and the weights after
optimizer steps are bit for bit those of the ``to_local`` path (``local_leaves = False``) and match
the single-device model's; the leaves' own ``.grad`` stays None; a parameter whose piece was
replaced is read anew."""

from __future__ import annotations

import torch
from harness import free_link_cpu

import autopar
from autopar.codegen.local_params import leaf_of
from autopar.examples import gpt2_tiny
from autopar.launch import run_on_ranks
from autopar.passes.strategies import AxisRole

STEPS = 3


def _build():
    return gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128)


def _run(pmodel, inputs, leaves: bool) -> tuple[list[float], dict, dict]:
    """Losses of ``STEPS`` SGD steps (gradients of each backward accumulated twice), the full
    gradients of the last backward and the full weights after."""
    pmodel.local_leaves = leaves
    opt = pmodel.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        for _ in range(2):  # the second backward accumulates into .grad
            loss = pmodel(**inputs).loss
            loss.backward()
        losses.append(float(loss.detach()))
        grads = {k: v.clone() for k, v in pmodel.full_grads().items()}
        opt.step()
        opt.zero_grad()
    return losses, grads, {k: v.clone() for k, v in pmodel.full_state_dict().items()}


def _rank(rank, world, plan_path):
    out = {}
    for leaves in (False, True):
        model, inputs = _build()
        pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=plan_path)
        out[leaves] = _run(pmodel, inputs, leaves)
    params = list(pmodel.parameters())
    out["leaf_grads"] = [leaf_of(p).leaf.grad for p in params if leaf_of(p) is not None]
    out["with_leaves"] = sum(leaf_of(p) is not None for p in params)
    # a parameter whose local piece is replaced: the next forward reads the new values
    with torch.no_grad():
        for p in params:
            p._local_tensor.data = torch.zeros_like(p._local_tensor)
    out["zeroed_loss"] = float(pmodel(**inputs).loss)
    return out


def _single() -> tuple[list[float], float]:
    model, inputs = _build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        for _ in range(2):
            loss = model(**inputs).loss
            loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return losses, float(model(**inputs).loss)


def test_leaves_give_the_to_local_path_s_gradients_and_weights(tmp_path):
    model, inputs = _build()
    plan = autopar.plan(
        model, free_link_cpu(2), inputs, mesh_shape=(2,), axis_roles=(AxisRole.DATA,), zero_stage=0
    )
    path = tmp_path / "plan.json"
    plan.save(path)
    losses, zeroed = _single()
    for res in run_on_ranks(_rank, 2, str(path), timeout_s=300):
        assert res["with_leaves"] > 0
        assert all(g is None for g in res["leaf_grads"])
        (la, ga, wa), (lb, gb, wb) = res[False], res[True]
        assert la == lb
        assert ga.keys() == gb.keys() and wa.keys() == wb.keys()
        for k in ga:
            assert torch.equal(ga[k], gb[k]), k
        for k in wa:
            assert torch.equal(wa[k], wb[k]), k
        torch.testing.assert_close(torch.tensor(lb), torch.tensor(losses), rtol=1e-4, atol=1e-5)
        assert abs(res["zeroed_loss"] - zeroed) <= 1e-5 * abs(zeroed)
