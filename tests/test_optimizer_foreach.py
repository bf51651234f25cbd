"""``ParallelModule.optimizer`` steps ``DTensor`` parameters with the multi-tensor ("foreach") step
of the optimizers in ``codegen/zero.py:FOREACH_EXACT``: on 2 ranks, sharded and replicated
``DTensor`` parameters stepped that way end bit for bit where the single-device per-tensor step
takes the same weights and gradients."""

from __future__ import annotations

import torch

from autopar.codegen.zero import FOREACH_EXACT, AppliedTrades
from autopar.launch import run_on_ranks

STEPS = 4


def _case(cls):
    g = torch.Generator().manual_seed(7)
    weights = [torch.randn(8, 6, generator=g) for _ in range(4)]
    grads = [[torch.randn(8, 6, generator=g) for _ in weights] for _ in range(STEPS)]
    return weights, grads


def _single(cls) -> list[torch.Tensor]:
    weights, grads = _case(cls)
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = cls(params, lr=1e-2, foreach=False)
    for step in grads:
        for p, gr in zip(params, step):
            p.grad = gr.clone()
        opt.step()
    return [p.detach() for p in params]


def _rank(rank: int, world: int, names: list[str]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    classes = {c.__name__: c for c in FOREACH_EXACT}
    out = {}
    for name in names:
        weights, grads = _case(classes[name])
        place = [[Shard(0)] if i % 2 else [Replicate()] for i in range(len(weights))]
        params = [torch.nn.Parameter(distribute_tensor(w, mesh, pl)) for w, pl in zip(weights, place)]
        opt = AppliedTrades().optimizer(params, classes[name], lr=1e-2)
        for step in grads:
            for p, gr, pl in zip(params, step, place):
                p.grad = distribute_tensor(gr, mesh, pl)
            opt.step()
        out[name] = (opt.defaults.get("foreach"), [p.full_tensor() for p in params])
    return out


def test_foreach_step_of_dtensor_parameters_equals_the_per_tensor_step():
    names = sorted(c.__name__ for c in FOREACH_EXACT)
    results = run_on_ranks(_rank, 2, names, timeout_s=240)
    for name in names:
        cls = next(c for c in FOREACH_EXACT if c.__name__ == name)
        ref = _single(cls)
        for res in results:
            foreach, got = res[name]
            assert foreach is True, name
            for a, b in zip(got, ref):
                assert torch.equal(a, b), f"{name}: {(a - b).abs().max()}"
