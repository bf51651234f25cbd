"""Overlapped gradient all-reduce (passes/grad_sync.py, codegen/grad_sync.py) gives the gradients of
the single-device model in every way a user may run backward: one backward, gradient accumulation
over two backwards, into zeroed (not None) gradients, and ``torch.autograd.grad``."""

from __future__ import annotations

import pytest
import torch
from harness import free_link_cpu

import autopar
from autopar.codegen import collectives as C
from autopar.examples import gpt2_tiny
from autopar.launch import run_on_ranks
from autopar.passes.grad_sync import deferred_grad_axes
from autopar.passes.strategies import AxisRole

D, T = AxisRole.DATA, AxisRole.TENSOR


def _build():
    return gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128)


def _loss(model, inputs):
    return model(**inputs).loss


def _reference_grads():
    """name -> gradient of the single-device model: one backward, and two backwards accumulated."""
    model, inputs = _build()
    _loss(model, inputs).backward()
    one = {n: p.grad.clone() for n, p in model.named_parameters()}
    _loss(model, inputs).backward()
    two = {n: p.grad.clone() for n, p in model.named_parameters()}
    return one, two


def _full_grads(pmodel) -> dict[str, torch.Tensor]:
    shape = tuple(pmodel.mesh.shape)
    out = {}
    for fqn, (attr, spec) in pmodel._state_specs.items():
        p = getattr(pmodel.local, attr)
        if isinstance(p, torch.nn.Parameter) and p.grad is not None:
            out[fqn] = C.gather_full(p.grad, spec, shape).clone()
    return out


def _rank(rank, world, plan_path):
    model, inputs = _build()
    cluster = free_link_cpu(world)
    pmodel = autopar.autoparallelize(model, cluster, inputs, plan=plan_path)
    params = list(pmodel.parameters())
    res = {"deferred": len(pmodel.grad_sync._axes)}
    _loss(pmodel, inputs).backward()
    res["one"] = _full_grads(pmodel)
    _loss(pmodel, inputs).backward()  # accumulates into .grad: reduced inline
    res["two"] = _full_grads(pmodel)
    for p in params:
        p.grad.zero_()  # zeroed, not None
    _loss(pmodel, inputs).backward()
    res["zeroed"] = _full_grads(pmodel)
    for p in params:
        p.grad = None
    grads = torch.autograd.grad(_loss(pmodel, inputs), params)
    for p, g in zip(params, grads):
        p.grad = g
    res["autograd_grad"] = _full_grads(pmodel)
    res["code"] = pmodel.code
    return res


def _f_uses(tg, choice, mesh_shape, deferred=None) -> dict[str, list[tuple[int, ...]]]:
    """Parameter -> for each use, the axes of the "f" the inline lowering puts on it (read from
    the generated graph: the chain of collectives between the parameter and the op using it)."""
    from autopar.codegen.lower import lower, mangle

    params = {mangle(p.target): p.name for p in tg.placeholders if p.role.value == "param"}
    attrs = {attr: torch.nn.Parameter(torch.empty(0)) for attr in params}
    gm = lower(tg, choice, mesh_shape, torch.device("cpu"), attrs, deferred)
    coll = {getattr(C, n) for n in ("f", "all_gather", "chunk", "all_reduce", "reduce_scatter", "to_partial")}
    out: dict[str, list[tuple[int, ...]]] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target not in params:
            continue
        uses = out.setdefault(params[node.target], [])
        stack = [(u, ()) for u in node.users]
        while stack:
            u, axes = stack.pop()
            if u.target in coll:
                axes = axes + ((u.args[1],) if u.target is C.f else ())
                stack.extend((v, axes) for v in u.users)
            else:
                uses.append(tuple(sorted(axes)))
    return out


@pytest.mark.parametrize(
    "world,mesh,roles", [(2, (2,), (D,)), (2, (2,), (T,)), (4, (2, 2), (D, T)), (4, (2, 2), None)]
)
def test_deferred_exactly_where_every_use_has_the_same_f(world, mesh, roles):
    """A parameter's gradient is reduced after accumulation exactly when the inline code puts the
    same "f" on every one of its uses; the deferred code then has no "f" on it at all."""
    model, inputs = _build()
    cluster = free_link_cpu(world)
    res = autopar.search(model, cluster, inputs, mesh_shape=mesh, axis_roles=roles)
    deferred = deferred_grad_axes(res.traced, res.choice, mesh)
    uses = _f_uses(res.traced, res.choice, mesh)
    expect = {p: u[0] for p, u in uses.items() if u and len(set(u)) == 1 and u[0]}
    assert deferred == expect
    after = _f_uses(res.traced, res.choice, mesh, deferred)
    assert all(after[p] == [()] * len(uses[p]) for p in deferred)
    assert all(after[p] == uses[p] for p in uses if p not in deferred)
    if roles == (D,):
        assert deferred, "a data-parallel plan reduces some gradient"


@pytest.mark.slow
def test_overlapped_grads_match_single_device(tmp_path):
    model, inputs = _build()
    cluster = free_link_cpu(2)
    path = tmp_path / "dp.json"
    autopar.plan(model, cluster, inputs, mesh_shape=(2,), axis_roles=(D,)).save(path)
    one, two = _reference_grads()
    for res in run_on_ranks(_rank, 2, str(path)):
        assert res["deferred"] > 0
        assert "autopar.codegen.collectives.f(" not in res["code"]
        for case, ref in (("one", one), ("two", two), ("zeroed", one), ("autograd_grad", one)):
            got = res[case]
            assert set(got) <= set(ref) and got, case
            for name, g in got.items():
                torch.testing.assert_close(g, ref[name], rtol=1e-4, atol=1e-5, msg=f"{case}: {name}")
