"""A model on the meta device initialized with its own initializers, a part at a time.

``codegen/weights.py`` asks ``Initializer`` for what neither the weights given nor the model
hold. A copy of the (meta) model is cut into
*units*: the largest subtrees of at most ``max(largest tensor, model / 8)`` bytes, so a repeated
layer is one unit. Unit by unit, in the model's order, every rank materializes the unit's whole
tensors on its device, runs the model's own initializers on it, keeps its pieces and frees the
rest: Hugging Face models through their ``_init_weights`` (per module, children first, as
``post_init`` runs it), other modules through ``reset_parameters()``. Every rank draws the same
values (same seed, same order), so replicas agree and the pieces of a tensor are pieces of one
tensor; the values are those of the same procedure on one device: they depend on the seed and the
model, not on the plan or the number of ranks, but they are not the values the model's
constructor would have drawn on a real device (its draws happen in another order). Seed every
rank alike (``torch.manual_seed``) before ``autoparallelize``. A rank holds its pieces plus one
unit whole. A tensor no initializer writes (checked: filled with NaN, or the smallest integer,
before) is an error naming it and the fix. An initializer of a module larger than a unit that
writes into its children (none in Hugging Face's transformer models) would write into meta
tensors: give such a model ``weights=``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable

import torch


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _own(m: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        (n, t)
        for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
        if t is not None
    ]


class Initializer:
    """The model's own initializers run on a copy of a meta-device model, one unit at a time
    (module docstring); ``pieces`` yields (state name, whole tensor) of every tensor, each unit's
    tensors valid until the next unit is made."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model = copy.deepcopy(model)  # materialized and freed unit by unit; the user's is left
        self.device = device
        sizes = {id(t): _nbytes(t) for t in [*self.model.parameters(), *self.model.buffers()]}
        total = sum(sizes.values())
        self.budget = max([*sizes.values(), math.ceil(total / 8), 1])

    def _units(self) -> list[tuple[str, torch.nn.Module, bool]]:
        """(prefix, module, whole subtree?) in the model's order: subtrees within the budget, and
        the larger modules above them for their own tensors."""
        out = []

        def size(m):
            return sum(_nbytes(t) for t in {id(t): t for t in [*m.parameters(), *m.buffers()]}.values())

        def walk(prefix, m):
            if size(m) <= self.budget or not list(m.children()):
                out.append((prefix, m, True))
                return
            for name, child in m.named_children():
                walk(f"{prefix}{name}.", child)
            if _own(m):
                out.append((prefix, m, False))

        walk("", self.model)
        return out

    def _hf_owner(self, module_path: str):
        """The nearest Hugging Face ``PreTrainedModel`` at or above ``module_path`` (None: none)."""
        owner = None
        m = self.model
        parts = [p for p in module_path.split(".") if p]
        chain = [m]
        for p in parts:
            m = getattr(m, p)
            chain.append(m)
        for m in chain:
            if hasattr(m, "_init_weights") and hasattr(m, "config"):
                owner = m
        return owner

    @torch.no_grad()
    def _init(self, prefix: str, unit: torch.nn.Module, recurse: bool) -> None:
        modules = list(unit.named_modules()) if recurse else [("", unit)]
        for name, m in reversed(modules):  # children first, as post_init runs it
            path = (prefix + name).rstrip(".")
            owner = self._hf_owner(path)
            if owner is not None:
                owner._init_weights(m)
            if any(unset(t) for _, t in _own(m)) and hasattr(m, "reset_parameters"):
                m.reset_parameters()

    def pieces(self, wanted: set[str] | None = None) -> Iterable[tuple[str, torch.Tensor]]:
        """(name, whole tensor) of every tensor of the units holding one of ``wanted`` (None:
        all), each unit's valid until the next is made."""
        for prefix, unit, recurse in self._units():

            def tensors(unit=unit, prefix=prefix, recurse=recurse):
                return [(prefix + n, t) for n, t in (_named_state(unit) if recurse else _own(unit))]

            if wanted is not None and not any(n in wanted for n, _ in tensors()):
                continue
            if not any(t.is_meta for _, t in tensors()):
                yield from tensors()
                continue
            unit.to_empty(device=self.device, recurse=recurse)
            for _, t in tensors():
                _poison(t)
            self._init(prefix, unit, recurse)
            yield from tensors()
            unit.to_empty(device="meta", recurse=recurse)


def _named_state(m: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)]


def _poison(t: torch.Tensor) -> None:
    """Fill a fresh tensor with what no initializer writes, so that one left alone is caught."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.data.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.data.fill_(torch.iinfo(t.dtype).min)


def unset(t: torch.Tensor) -> bool:
    """Did no initializer write (part of) ``t``? (``_poison``'s fill is left)"""
    if t.is_meta or t.numel() == 0:
        return False
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return False
    return bool((t == torch.iinfo(t.dtype).min).all())
