"""Uses of one tensor that need the same reshard share one (passes/grad_sync.py:reshard_key).

Megatron-LM puts one "f" on the input of a transformer block's q, k and v projections, and a
PaLM-style parallel block has one input for attention and MLP alike: the backward all-reduce of
that input's gradient runs once, on the sum of the uses' gradients. Here the generated code runs
each distinct reshard once, and the plan prices what the code runs: the backward all-reduces it
lists are the code's "f" calls, one for one. (That the shared code computes the single-device
model's losses and gradients is tests/test_correctness_dist.py and
tests/test_correctness_more_models.py, on the same models and plans.)"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.codegen import collectives as C
from autopar.codegen.lower import lower, mangle
from autopar.examples import llama_tiny, palm_tiny
from autopar.passes.analyze import analyze
from autopar.passes.grad_sync import deferred_grad_axes
from autopar.passes.strategies import AxisRole
from autopar.plan import Site
from autopar.reshard import Collective, Phase

D, T = AxisRole.DATA, AxisRole.TENSOR
COLLECTIVES = {
    getattr(C, n) for n in ("f", "all_gather", "chunk", "all_reduce", "reduce_scatter", "to_partial")
}
MODELS = {
    "llama": lambda: llama_tiny(batch=4, seq=16, hidden=32, vocab=128),
    "palm": lambda: palm_tiny(batch=4, seq=16, hidden=32, heads=4, vocab=128),
}


def _lowered(res, mesh):
    tg = res.traced
    attrs = {
        mangle(p.target): torch.nn.Parameter(torch.empty(0)) if p.role.value == "param" else torch.empty(0)
        for p in tg.placeholders
        if p.role.value in ("param", "buffer")
    }
    deferred = deferred_grad_axes(tg, res.choice, mesh)
    return lower(tg, res.choice, mesh, attrs, deferred)


def _search(name, world, mesh, roles, cluster=None):
    model, inputs = MODELS[name]()
    cluster = cluster or autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    return autopar.search(model, cluster, inputs, mesh_shape=mesh, axis_roles=roles)


@pytest.mark.parametrize(
    "name,world,mesh,roles",
    [
        ("llama", 2, (2,), (T,)),
        ("palm", 2, (2,), (T,)),
        ("palm", 4, (2, 2), (D, T)),
        ("llama", 4, (2, 2), None),
    ],
)
def test_each_reshard_runs_once_and_the_plan_lists_what_runs(name, world, mesh, roles):
    res = _search(name, world, mesh, roles)
    gm = _lowered(res, mesh)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVES]
    keys = [(n.target, n.args) for n in calls]
    assert len(keys) == len(set(keys)), "a collective runs twice on the same tensor"
    # every "f" on a tensor that carries a gradient is one backward all-reduce the plan lists
    listed = sum(
        1
        for d in res.plan.decisions
        for c in d.collectives
        if c.kind is Collective.ALL_REDUCE and c.phase is Phase.BACKWARD and c.site is not Site.BUCKET
    )
    tg = res.traced
    grads = {name for name, info in analyze(tg).items() if info.requires_grad}
    params = {mangle(p.target): p.name for p in tg.placeholders}
    emitted = 0
    for n in calls:
        if n.target is C.f:
            root = _root(n.args[0])
            traced = params[root.target] if root.op == "get_attr" else root.meta.get("traced", root.name)
            emitted += traced in grads
    assert listed == emitted
    if roles and T in roles:
        assert emitted, "a tensor-parallel block reduces its input's gradient"


def _root(n):
    while n.op == "call_function" and n.target in COLLECTIVES:
        n = n.args[0]
    return n


def test_palm_tensor_parallel_block_input_gets_one_f_for_its_projections():
    """The normed input of a parallel block feeds q and the SwiGLU's two up projections (k and v,
    one head, take it another way here): their backward reduces its gradient once, not per
    projection."""
    res = _search("palm", 2, (2,), (T,))
    gm = _lowered(res, (2,))
    users = [
        sum(1 for u in n.users if u.target is torch.ops.aten.linear.default)
        for n in gm.graph.nodes
        if n.target is C.f
    ]
    assert max(users) >= 3, users


def test_sharing_lowers_the_predicted_step_by_what_the_duplicates_cost():
    """The plan's step is the cost tables' total (every use priced on its own) less the reshards
    that uses share: here, per layer, the all-reduces of the block input's gradient that q/k/v and
    gate/up would each run, and the all-reduce of the rotary tables' (no gradient: free)."""
    from autopar.cost_model.comm import CommModel
    from autopar.passes.grad_sync import plan_uses, shared_reshards_s

    res = _search("llama", 2, (2,), (T,))
    tg, choice = res.traced, res.choice
    comm = CommModel(autopar.ClusterSpec.from_dict(res.plan.cluster), (2,))
    deferred = deferred_grad_axes(tg, choice, (2,))
    infos = analyze(tg)
    dup = [u for u in plan_uses(tg, choice, deferred) if not u.runs]
    pure = [
        u for u in dup if choice[u.src].out == u.need and u.fops == (0,) and infos[u.inp.name].requires_grad
    ]
    assert len(pure) >= 3 * 2, "per layer, k and v share q's input, up shares gate's"
    want = shared_reshards_s(plan_uses(tg, choice, deferred), infos, choice, comm)
    by_hand = sum(comm.time(Collective.ALL_REDUCE, infos[u.inp.name].out_bytes, 0) for u in pure)
    assert want >= by_hand > 0
    objective = res.plan.solver.objective
    overhead = comm.cluster.device.step_overhead_s * comm.cluster.compute_slowdown
    # the sync wait is what is left: it is >= 0 and only falls when collectives go away
    rest = res.plan.predicted.step_time_s - (objective - want + overhead)
    assert 0.0 <= rest < want


@pytest.mark.parametrize("name,world,mesh,roles", [("llama", 2, (2,), (T,)), ("palm", 2, (2,), (T,))])
def test_the_solver_prices_a_shared_reshard_once(name, world, mesh, roles, monkeypatch):
    """The ILP pays a reshard that several edges of one tensor run once (``z``, passes/solver.py).
    Its plan is at least as fast, priced as it runs, as the plan of an ILP that pays every edge."""
    import autopar.passes.solver as solver

    shared = _search(name, world, mesh, roles).plan.predicted.step_time_s
    monkeypatch.setattr(solver, "_sharing_groups", lambda edges: {})
    per_edge = _search(name, world, mesh, roles).plan.predicted.step_time_s
    assert shared <= per_edge * (1 + 1e-9)
