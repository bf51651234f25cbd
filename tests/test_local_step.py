"""``codegen/local_step.py``: a data-parallel plan's optimizer steps its replicated ``DTensor``
parameters on plain aliases of their local tensors. On 2 ranks, for every optimizer of
``FOREACH_EXACT``, the weights end bit for bit where the single-device per-tensor step takes them,
through a learning-rate change made on the user-facing groups and a parameter whose local tensor
was replaced between steps; and the step dispatches nothing through ``DTensor``, where the same
optimizer over the ``DTensor`` parameters does."""

from __future__ import annotations

import torch

from autopar.codegen.zero import FOREACH_EXACT, AppliedTrades
from autopar.launch import run_on_ranks

STEPS = 4


def _case():
    g = torch.Generator().manual_seed(11)
    weights = [torch.randn(8, 6, generator=g) for _ in range(3)] + [torch.randn(5, generator=g)]
    grads = [[torch.randn(w.shape, generator=g) for w in weights] for _ in range(STEPS)]
    return weights, grads


def _single(cls) -> list[torch.Tensor]:
    weights, grads = _case()
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = cls(params, lr=1e-2, foreach=False)
    for i, step in enumerate(grads):
        if i == 2:
            opt.param_groups[0]["lr"] = 3e-3
            params[0].data = params[0].data.clone()  # as a load that assigns would
        for p, gr in zip(params, step):
            p.grad = gr.clone()
        opt.step()
    return [p.detach() for p in params]


def _dispatches(opt, params, grads) -> int:
    """Ops with a ``DTensor`` argument during one ``opt.step()`` (each a ``DTensor`` dispatch)."""
    import torch.utils._pytree as pytree
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(isinstance(t, DTensor) for t in pytree.tree_leaves((args, kwargs))):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    for p, gr in zip(params, grads):
        p.grad = gr
    with Count():
        opt.step()
    return Count.n


def _train(cls, mesh):
    """``STEPS`` of ``cls`` through ``ParallelModule.optimizer``'s path, with the lr change and the
    replaced parameter ``_single`` makes: (the parameters, the optimizer)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    weights, grads = _case()
    params = [torch.nn.Parameter(distribute_tensor(w, mesh, [Replicate()])) for w in weights]
    opt = AppliedTrades().optimizer(params, cls, lr=1e-2)
    for i, step in enumerate(grads):
        if i == 2:
            opt.param_groups[0]["lr"] = 3e-3
            p = params[0]
            p.data = DTensor.from_local(p._local_tensor.clone(), mesh, [Replicate()], run_check=False)
        for p, gr in zip(params, step):
            p.grad = distribute_tensor(gr, mesh, [Replicate()])
        opt.step()
    return params, opt


def _rank(rank: int, world: int, names: list[str]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from autopar.codegen.local_step import LocalStepOptimizer

    mesh = init_device_mesh("cpu", (world,))
    classes = {c.__name__: c for c in FOREACH_EXACT}
    out = {}
    for name in names:
        params, opt = _train(classes[name], mesh)
        assert isinstance(opt, LocalStepOptimizer), type(opt)
        weights = [t.full_tensor().clone() for t in params]  # before the dispatch count's extra steps
        # every alias's state under its parameter (SGD without momentum keeps none)
        keyed = len(opt.state) == len(opt.inner.state) and all(
            opt.state[p] is opt.inner.state[opt._alias[id(p)]] for p in params if p in opt.state
        )
        # the dispatch the local step avoids: the same optimizer over the DTensor parameters pays it
        plain = classes[name](params, lr=1e-2, foreach=True)
        g = [distribute_tensor(t, mesh, [Replicate()]) for t in _case()[1][0]]
        counts = (_dispatches(opt, params, g), _dispatches(plain, params, g))
        out[name] = (weights, keyed, counts)
    return out


def test_replicated_parameters_step_on_their_local_tensors_as_one_device_does():
    names = sorted(c.__name__ for c in FOREACH_EXACT)
    results = run_on_ranks(_rank, 2, names, timeout_s=240)
    for name in names:
        cls = next(c for c in FOREACH_EXACT if c.__name__ == name)
        ref = _single(cls)
        for got, keyed, (local, dtensor) in (res[name] for res in results):
            for a, b in zip(got, ref):
                assert torch.equal(a, b), f"{name}: {(a - b).abs().max()}"
            assert keyed, f"{name}: the state is not under the parameters"
            assert local == 0, f"{name}: {local} DTensor dispatches in the local step"
            assert dtensor > 0, name
