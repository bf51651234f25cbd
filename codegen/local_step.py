"""The optimizer step of a plan whose parameters are all whole on every rank, on plain tensors.

Under data parallelism (ZeRO 0) every parameter is a ``DTensor`` replicated on every mesh axis, and
a torch optimizer over them dispatches each of its update ops through ``DTensor``: sharding
propagation and spec hashing per op (a foreach Adam: about 12 ops a step, each tens of
microseconds of host time; 252 ``DTensorSpec.__hash__`` calls a tiny Llama step), where
``DistributedDataParallel``'s plain parameters pay none (``benchmarks/bench_vs_torch.py``,
``profile_vs_torch.py``). A replicated ``DTensor``'s local tensor *is* the whole parameter, so
``LocalStepOptimizer`` runs ``optimizer_class`` over plain aliases of those local tensors (same
storage, no copy): the update is the same op on the same numbers, bit for bit, without the
dispatch (``tests/test_local_step.py``).

What the user sees is the optimizer over the module's parameters, as before:

* ``param_groups`` hold the ``DTensor`` parameters (a ``torch.amp.GradScaler`` unscales their
  gradients there; an LR scheduler edits these groups), and ``step`` copies each group's
  hyperparameters to the inner optimizer's group before it steps;
* ``step`` hands each parameter's gradient to its alias as the gradient's local tensor (no copy);
* ``state`` is keyed by the parameters and holds the inner optimizer's state of each alias (plain
  tensors: the whole state, the same on every rank, as ``DistributedDataParallel``'s optimizer
  keeps it); ``codegen/state.py``'s ``optimizer_state_dict`` / ``load_optimizer_state_dict`` and
  ``torch.distributed.checkpoint`` read and write it there;
* a parameter whose local tensor was replaced (a load that assigns ``p.data``) gets a new alias,
  its state moved over, before the next step.

Why by hand: no torch optimizer steps a ``DTensor`` parameter on its local tensor; FSDP2 steps its
sharded ``DTensor`` parameters through the same dispatch, and ``DistributedDataParallel`` has plain
parameters to begin with.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch.distributed.tensor import DTensor, Replicate

from autopar.codegen.local_params import clear_grads


def all_replicated(params: list[torch.Tensor]) -> bool:
    """Every parameter a ``DTensor`` whole on every axis of its mesh (and at least one)."""
    return bool(params) and all(
        isinstance(p, DTensor) and all(isinstance(q, Replicate) for q in p.placements) for p in params
    )


class _StateView(Mapping):
    """The inner optimizer's state under the parameters' keys (module docstring)."""

    def __init__(self, owner: LocalStepOptimizer):
        self._owner = owner

    def __getitem__(self, p):
        alias = self._owner._alias.get(id(p))
        if alias is None or alias not in self._owner.inner.state:
            raise KeyError(p)
        return self._owner.inner.state[alias]

    def __iter__(self) -> Iterator:
        state = self._owner.inner.state
        return (p for p in self._owner.params if self._owner._alias[id(p)] in state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class LocalStepOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` over plain aliases of ``params``' local tensors; ``params`` all
    replicated ``DTensor``s (``all_replicated``). Module docstring."""

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizer_class, **kwargs):
        self.params = list(params)
        self._src = {id(p): p._local_tensor for p in self.params}
        self._alias = {id(p): p._local_tensor.detach() for p in self.params}
        self.inner = optimizer_class([self._alias[id(p)] for p in self.params], **kwargs)
        self._built = False
        super().__init__(self.params, self.inner.defaults)
        self._built = True
        self.state = _StateView(self)
        self._pair()

    def _pair(self) -> None:
        """Per group, each parameter with its local tensor when aliased and its alias: what a step
        reads, with no ``id`` lookups per parameter."""
        self._pairs = [
            [(p, self._src[id(p)], self._alias[id(p)]) for p in group["params"]]
            for group in self.param_groups
        ]

    def _refresh(self) -> None:
        """A new alias, with the old one's state, for each parameter whose local tensor changed."""
        changed = False
        for pairs in self._pairs:  # a loop, not all(genexpr): no call per parameter
            for p, src, _ in pairs:
                if p._local_tensor is not src:
                    changed = True
        if not changed:
            return
        for p in self.params:
            if p._local_tensor is self._src[id(p)]:
                continue
            old, new = self._alias[id(p)], p._local_tensor.detach()
            self._src[id(p)], self._alias[id(p)] = p._local_tensor, new
            for g in self.inner.param_groups:
                g["params"] = [new if t is old else t for t in g["params"]]
            if old in self.inner.state:
                self.inner.state[new] = self.inner.state.pop(old)
        self._pair()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refresh()
        for outer, inner, pairs in zip(self.param_groups, self.inner.param_groups, self._pairs):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v
            for p, _, alias in pairs:
                g = p.grad
                # ``type is`` first: a DTensor gradient (the usual) costs no isinstance call
                alias.grad = (
                    None
                    if g is None
                    else (g._local_tensor if type(g) is DTensor or isinstance(g, DTensor) else g)
                )
        self.inner.step()
        for pairs in self._pairs:
            for _, _, alias in pairs:
                alias.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        clear_grads(self.params, set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_built", True):  # torch.optim.Optimizer.__init__ adds the first group
            return super().add_param_group(param_group)
        raise NotImplementedError(
            "pmodel.optimizer(...) takes its parameters at construction: build a new one with every group"
        )

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._refresh()
        self.inner.load_state_dict(state_dict)
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            outer.update({k: v for k, v in inner.items() if k != "params"})
