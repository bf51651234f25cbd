"""An unrolled loop's steps share their ILP variables (``passes/coarsen.py``, ``loop_steps``): a
small selective scan, as Hugging Face's Mamba runs it without its CUDA kernel, coarsens to one
class per op of a step, and the search under a memory limit plans what the uncoarsened search
plans, the brute-force optimum on this graph."""

from __future__ import annotations

import pytest
import torch
from harness import ring_scatter_cpu, sgd_losses
from torch import nn

import autopar
from autopar.launch import run_on_ranks
from autopar.options import AxisRole
from autopar.passes.analyze import analyze
from autopar.passes.coarsen import LOOP_MIN_STEPS, find_classes
from autopar.passes.strategies import variable_nodes
from autopar.passes.trace import trace

STEPS = 6


class Scan(nn.Module):
    """h_t = a_t * h_{t-1} + b_t, y_t = h_t . c_t: a selective scan unrolled over ``steps``."""

    def __init__(self, d: int = 16, n: int = 4, steps: int = STEPS):
        super().__init__()
        self.inp = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.n, self.steps = n, steps

    def forward(self, x):  # x: [batch, steps, d]
        a, b, c = self.inp(x).chunk(3, dim=-1)
        a = torch.sigmoid(a).transpose(1, 2)[..., None].expand(-1, -1, -1, self.n)  # [B, d, L, n]
        b = b.transpose(1, 2)[..., None] * torch.ones(self.n)
        h = torch.zeros(x.shape[0], x.shape[2], self.n)
        ys = []
        for t in range(self.steps):
            h = a[:, :, t] * h + b[:, :, t]
            ys.append((h * c[:, t, :, None]).sum(-1))
        return self.out(torch.stack(ys, dim=1))


class Net(nn.Module):
    def __init__(self, layers: int = 2, steps: int = STEPS):
        super().__init__()
        self.layers = nn.ModuleList(Scan(steps=steps) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x.pow(2).mean()


def _classes(model, x):
    tg = trace(model, (x,))
    infos = analyze(tg)
    return tg, find_classes(tg, infos, variable_nodes(tg))


def test_each_op_of_a_step_is_one_class():
    torch.manual_seed(0)
    tg, classes = _classes(Net(), torch.randn(4, STEPS, 16))
    nodes = [n for n in tg.graph.nodes if n.op == "call_function" and n.name in classes.rep]
    steps = {}  # class -> members, for the classes with more members than layers
    for n in nodes:
        members = classes.members[classes.rep[n.name]]
        if len(members) > 2:
            steps[classes.rep[n.name]] = members
    # per step: the selects of a and b (one shape: one class), h = a * h + b (mul, add), the
    # select of c, its unsqueeze, the product and its sum; each class every step of both layers
    assert sorted(len(m) for m in steps.values()) == [2 * STEPS] * 6 + [2 * 2 * STEPS]
    ops = {str(n.target) for n in nodes if n.name in steps}
    assert ops == {"aten.select.int", "aten.mul.Tensor", "aten.add.Tensor", "aten.unsqueeze.default",
                   "aten.sum.dim_IntList"}  # fmt: skip
    # the layers' other ops (chunk, transposes, the linears) stay one per layer, the loss's alone
    tied = {m for ms in steps.values() for m in ms}
    assert {len(classes.members[classes.rep[n.name]]) for n in nodes if n.name not in tied} == {1, 2}


def test_a_short_loop_stays_distinct():
    torch.manual_seed(0)
    steps = LOOP_MIN_STEPS - 1
    tg, classes = _classes(Net(steps=steps), torch.randn(4, steps, 16))
    selects = [n.name for n in tg.graph.nodes if n.target is torch.ops.aten.select.int]
    # only the layers' twins share a class: 2 members each
    assert {len(classes.members[classes.rep[s]]) for s in selects} == {2}


@pytest.mark.parametrize("fraction", [None, 0.7])
def test_limited_search_plans_as_the_uncoarsened_one(fraction):
    """The same placements with the loop's steps tied as with every node free (no coarsening: the
    ILP's optimum over every assignment), free and under a limit that changes the plan."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, STEPS, 16)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    kw = dict(axis_roles=(AxisRole.AUTO,), optimizer=autopar.Optimizer.SGD)
    free = autopar.plan(model, cluster, (x,), coarsen=False, **kw)
    limit = None
    if fraction is not None:
        limit = fraction * free.predicted.peak_memory_bytes / (1 - cluster.memory_reserve)
    exact = autopar.plan(model, cluster, (x,), coarsen=False, memory_limit_bytes=limit, **kw)
    tied = autopar.plan(model, cluster, (x,), memory_limit_bytes=limit, **kw)
    if limit is not None:
        assert exact.predicted.peak_memory_bytes < free.predicted.peak_memory_bytes  # the limit binds
        assert tied.predicted.peak_memory_bytes <= limit
    assert tied.mesh_shape == exact.mesh_shape
    assert {d.name: (d.output, d.inputs) for d in tied.decisions} == {
        d.name: (d.output, d.inputs) for d in exact.decisions
    }
    # a class's price is its members' (their uses, their first step's constant input) as its
    # representative's: within 0.2% of the plain tables' (tests/test_pipeline_search.py)
    assert tied.predicted.step_time_s == pytest.approx(exact.predicted.step_time_s, rel=2e-3)


def _rank(rank: int, world: int, plan_path: str) -> list[float]:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, STEPS, 16)
    cluster = ring_scatter_cpu(world)
    pmodel = autopar.autoparallelize(model, cluster, (x,), plan=plan_path)
    return [float(v) for v in sgd_losses(pmodel, x)]


@pytest.mark.slow
def test_a_tied_plan_trains_as_the_model(tmp_path):
    """A plan with the loop's steps tied, each split over 2 gloo ranks (the tensor role forces a
    split), trains as the single-device model does."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, STEPS, 16)
    # a ring's reduce-scatter: the split selects are reduce-scattered into (gloo's all-reduce price
    # keeps them whole)
    cluster = ring_scatter_cpu(2)
    # one micro-batch, no pipeline: the step is the module's forward and backward (sgd_losses)
    plan = autopar.plan(
        model, cluster, (x,), axis_roles=(AxisRole.TENSOR,), micro_batches=1, pipeline_stages=1
    )
    tied = [d for d in plan.decisions if d.name.startswith("select")]
    assert len(tied) == 3 * 2 * STEPS and all(d.output != "R" for d in tied)  # every step's selects split
    path = tmp_path / "plan.json"
    plan.save(path)
    want = [float(v) for v in sgd_losses(model, x)]
    for got in run_on_ranks(_rank, 2, str(path), timeout_s=300):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
