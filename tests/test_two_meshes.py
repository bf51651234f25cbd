"""Two parallel modules on different meshes in one process group: each collective's backward runs
on the mesh its forward ran on (``codegen/collectives.py``), not on the last forward's.

On 4 gloo ranks, GPT-2 runs tensor parallel on a (4,) mesh and Llama data x tensor parallel on a
(2, 2) mesh. Both forwards run first, then one backward through both (``(loss_a + loss_b)
.backward()``, which interleaves their backward collectives), then an SGD step: the losses, the
gradients and the full state after the step equal the single-device models'. Outside a
module's forward no mesh is bound: a collective called there raises.
"""

from __future__ import annotations

import pytest
import torch
from harness import LR, D, T

import autopar
from autopar.codegen import collectives as C
from autopar.errors import DistributedSetupError
from autopar.examples import gpt2_tiny, llama_tiny
from autopar.launch import run_on_ranks

WORLD = 4
MODELS = {  # name -> (build, mesh shape, axis roles that force sharding on every axis)
    "gpt2": (lambda: gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128), (4,), (T,)),
    "llama": (lambda: llama_tiny(batch=4, seq=16, hidden=32, vocab=128), (2, 2), (D, T)),
}
# the collectives the generated code calls -> the position of their mesh-axis argument
AXIS_ARG = {
    C.all_gather: 2,
    C.chunk: 2,
    C.all_reduce: 1,
    C.all_reduce_deferred: 1,
    C.all_reduce_started: 1,
    C.mean_deferred: 2,
    C.reduce_scatter: 2,
    C.to_partial: 1,
    C.f: 1,
    C.batch_slice: 1,
}


def _build(name):
    return MODELS[name][0]()


def _reference(name):
    """(loss, name -> gradient, state after one SGD step) of the single-device model."""
    model, inputs = _build(name)
    loss = model(**inputs).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return loss.detach(), grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _full_grads(pmodel) -> dict[str, torch.Tensor]:
    """State-dict name -> full gradient (tied weights: under each of their names)."""
    full = pmodel.full_grads()
    return {name: full[fqn].clone() for name, fqn in pmodel._aliases.items() if fqn in full}


def _rank(rank, world, plans):
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    pmodels, inputs = {}, {}
    for name, path in plans.items():
        model, inputs[name] = _build(name)
        pmodels[name] = autopar.autoparallelize(model, cluster, inputs[name], plan=path)
    losses = {name: pm(**inputs[name]).loss for name, pm in pmodels.items()}  # both forwards first
    try:
        C.coordinate(0)
        left_bound = True
    except DistributedSetupError:
        left_bound = False
    sum(losses.values()).backward()  # then one backward through both
    res = {}
    for name, pm in pmodels.items():
        grads = _full_grads(pm)
        torch.optim.SGD(pm.parameters(), lr=LR).step()
        axes = {n.args[AXIS_ARG[n.target]] for n in pm.local.graph.nodes if n.target in AXIS_ARG}
        res[name] = (losses[name].detach(), grads, pm.full_state_dict(), axes)
    res["left_bound"] = left_bound
    return res


@pytest.mark.slow
def test_two_modules_on_different_meshes_backward_on_their_own_meshes(tmp_path):
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=WORLD)
    plans = {}
    for name, (build, mesh, roles) in MODELS.items():
        model, inputs = build()
        plan = autopar.plan(model, cluster, inputs, mesh_shape=mesh, axis_roles=roles)
        assert tuple(plan.mesh_shape) == mesh
        path = tmp_path / f"{name}.json"
        plan.save(path)
        plans[name] = str(path)
    per_rank = run_on_ranks(_rank, WORLD, plans, timeout_s=900)
    assert not any(r["left_bound"] for r in per_rank), "a mesh stayed bound after the modules' forward"
    for name, (_, mesh, _) in MODELS.items():
        ref_loss, ref_grads, ref_state = _reference(name)
        for rank, results in enumerate(per_rank):
            loss, grads, state, axes = results[name]
            # the generated code runs collectives on every axis of its mesh: both meshes are used
            assert axes == set(range(len(mesh))), f"{name}: collectives on axes {sorted(axes)} of mesh {mesh}"
            torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5, msg=f"{name} rank {rank} loss")
            assert set(ref_grads) <= set(grads), f"{name}: no gradient for {set(ref_grads) - set(grads)}"
            for k in ref_grads:
                torch.testing.assert_close(
                    grads[k], ref_grads[k], rtol=1e-4, atol=1e-5, msg=f"{name} rank {rank} gradient of {k}"
                )
            assert set(state) == set(ref_state)
            for k in ref_state:
                torch.testing.assert_close(
                    state[k], ref_state[k], rtol=1e-4, atol=1e-5, msg=f"{name} rank {rank} {k} after a step"
                )


def test_a_collective_outside_a_bound_mesh_raises_and_binds_nest():
    x = torch.ones(4, requires_grad=True)
    for call in (lambda: C.all_gather(x, 0, 0), lambda: C.f(x, 0), lambda: C.coordinate(0)):
        with pytest.raises(DistributedSetupError, match="bound_mesh"):
            call()
    outer, inner = object(), object()  # stand-ins: binding only records the mesh
    with C.bound_mesh(outer):
        with C.bound_mesh(inner):
            assert C.current_mesh() is inner
        assert C.current_mesh() is outer
        with pytest.raises(KeyError), C.bound_mesh(inner):
            raise KeyError("a forward that raises")
        assert C.current_mesh() is outer
    with pytest.raises(DistributedSetupError):
        C.current_mesh()
