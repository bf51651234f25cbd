"""Pipelined chunks compute on the parameters' plain leaves (``codegen/local_params.py``), as the
unpipelined forward does: a step reads no parameter through ``DTensor.to_local``, and its
gradients and loss are bit for bit those of the same module run through ``to_local``
(``ParallelModule.local_leaves`` False), summed over the micro-batches on the leaves or onto a
``.grad`` that holds values, on 2 gloo ranks, 1F1B over 4 micro-batches; with ZeRO-1
over a data-parallel stage mesh (4 ranks) the gradients reach the DTensor parameters' ``.grad``
through the leaves and the bucketed reductions alike. Against the single device: the loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import autopar
from autopar.launch import run_on_ranks
from autopar.trades import Schedule

pytestmark = pytest.mark.slow


class _Net(torch.nn.Module):
    def __init__(self, d: int = 16, layers: int = 4):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.head = torch.nn.Linear(d, d)

    def forward(self, x, y):
        for b in self.blocks:
            x = x + F.gelu(b(x))
        return F.mse_loss(self.head(x), y)


def _build():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return _Net(), {"x": torch.randn(8, 16, generator=g), "y": torch.randn(8, 16, generator=g)}


def _step(pm, inputs, leaves: bool, onto: float | None = None) -> tuple[torch.Tensor, dict, int]:
    """(loss, local gradients by name, DTensor.to_local calls) of one step; ``onto``: the value
    ``.grad`` holds before it (accumulated onto), else None."""
    pm.local_leaves = leaves
    for p in pm.parameters():
        p.grad = None if onto is None else torch.full_like(p, onto)
    calls = 0
    original = DTensor.to_local

    def counting(self, *a, **k):
        nonlocal calls
        calls += 1
        return original(self, *a, **k)

    DTensor.to_local = counting
    try:
        loss = pm.step(**inputs)
    finally:
        DTensor.to_local = original
    grads = {}
    for name, p in pm.named_parameters():
        assert isinstance(p.grad, DTensor), name  # the parameter's own .grad, whichever path
        grads[name] = p.grad.to_local().clone()
        p.grad = None
    return loss, grads, calls


def _rank(rank, world, path):
    model, inputs = _build()
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    pm = autopar.autoparallelize(model, cluster, inputs, plan=path)
    got = _step(pm, inputs, leaves=True)
    want = _step(pm, inputs, leaves=False)
    onto = _step(pm, inputs, leaves=True, onto=0.1), _step(pm, inputs, leaves=False, onto=0.1)
    return got, want, onto


@pytest.mark.parametrize(
    "world, extra",
    [
        (2, {"mesh_shape": (1,)}),
        (4, {"mesh_shape": (2,), "axis_roles": (autopar.AxisRole.DATA,), "zero_stage": 1}),
    ],
)
def test_pipelined_step_on_leaves_equals_to_local(tmp_path, world, extra):
    model, inputs = _build()
    want_loss = model(**inputs).detach()
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    plan = autopar.plan(
        model, cluster, inputs, pipeline_stages=2, schedule=Schedule.ONE_F_ONE_B, micro_batches=4, **extra
    )
    path = tmp_path / "plan.json"
    plan.save(path)
    for rank, (got, want, onto) in enumerate(run_on_ranks(_rank, world, str(path), timeout_s=240)):
        (loss, grads, calls), (loss0, grads0, calls0) = got, want
        # accumulated onto a .grad that holds values: the same on both paths, and not the fresh one
        (_, added, _), (_, added0, _) = onto
        for name in grads:
            torch.testing.assert_close(added[name], added0[name], rtol=0, atol=0, msg=f"rank {rank} {name}")
            torch.testing.assert_close(added[name], grads[name] + 0.1, rtol=1e-6, atol=1e-6)
        assert calls == 0 and calls0 > 0, (rank, calls, calls0)  # leaves: no to_local at all
        torch.testing.assert_close(loss, loss0, rtol=0, atol=0)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == grads0.keys() and grads
        for name in grads:
            torch.testing.assert_close(grads[name], grads0[name], rtol=0, atol=0, msg=f"rank {rank} {name}")
            assert grads[name].abs().sum() > 0, name
