"""Feeding data: what a rank-local module accepts as its inputs, and what it hands its graph.

Every input that *carries the batch* may be given whole on every rank, or as this rank's slice:
``1 / data_world`` of its rows, the slice ``data_rank`` (a loader's ``DistributedSampler``), the
global batch being the slices in ``data_rank`` order. The data axis is the first mesh axis that
splits an input's batch (dim 0); an input carries the batch where the data axis splits its rows, or
where it has as many rows as an input the data axis splits (the plan keeps it whole, or splits it
on another axis or dim). The inputs are fed all one way on every rank: all whole, or all sliced.

The generated graph takes the inputs the data axis splits whole or sliced
(``collectives.batch_slice`` slices the whole batch, takes a slice as it is) and every other input
whole. So where each rank was fed its slice, ``Feeding.to_graph`` gathers the others over the data
axis first: one all-gather of dim 0 each, whose backward keeps this rank's rows (the graph's
gradient of an input it holds whole is the whole gradient on every rank).

Errors name the inputs as the call does (``input_names``: a positional argument by the forward's
parameter name, a keyword argument by its key) and give the shapes each may have.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from autopar.codegen import collectives as C
from autopar.errors import AutoparError


class InputsError(AutoparError, ValueError):
    """A call's inputs do not fit the plan (their rows, their shapes, some whole and some sliced):
    the message names each input as the call does and the shapes it may have."""


def input_names(model: torch.nn.Module, args: tuple, kwargs: dict) -> list[str]:
    """The name of each input leaf, in ``pytree`` order, as a user calls the model: a positional
    argument's parameter name in ``model.forward`` ("input_ids"; ``args[i]`` past the named ones), a
    keyword argument's key ("labels"), then the path inside a nested one ("batch['ids']")."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # a forward without a signature Python can read
        params = ()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        where, key, rest = path[0], path[1], path[2:]
        if where.idx == 0:
            base = positional[key.idx] if key.idx < len(positional) else f"args[{key.idx}]"
        else:
            base = str(key.key)
        names.append(base + pytree.keystr(rest))
    return names


@dataclass(frozen=True)
class Feeding:
    """The inputs a module of a plan accepts (module docstring), per flattened input leaf: its
    name, the shape the plan takes (one micro-batch's where the plan runs several), and the mesh
    axis that splits its batch (None: none does)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    batch_axes: tuple[int | None, ...]
    data_world: int  # the data axis's ranks (1: no data axis)
    micro_batches: int = 1
    data_axis: int | None = field(init=False)
    carries: tuple[bool, ...] = field(init=False)  # per leaf: whether it carries the batch

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.shapes) == len(self.batch_axes):
            raise ValueError(
                f"one name, shape and batch axis per input: {len(self.names)}, {len(self.shapes)}, "
                f"{len(self.batch_axes)}"
            )
        axis = next((a for a in self.batch_axes if a is not None), None)
        rows = next((s[0] for s, a in zip(self.shapes, self.batch_axes) if a == axis and s), None)
        carries = tuple(
            axis is not None and bool(s) and (a == axis or s[0] == rows)
            for s, a in zip(self.shapes, self.batch_axes)
        )
        object.__setattr__(self, "data_axis", axis)
        object.__setattr__(self, "carries", carries)

    def slices(self, flat: Sequence, k: int = 1) -> int:
        """How many slices of the batch the inputs ``flat`` (``k`` of the plan's batches: ``step``'s
        micro-batches) are: 1 for the whole batch, ``data_world`` for this rank's slice. InputsError,
        naming the inputs, unless every input that carries the batch is one or the other, and all
        the same one."""
        n = self.data_world
        whole, sliced = [], []
        for name, t, shape, carries in zip(self.names, flat, self.shapes, self.carries):
            if not carries or not isinstance(t, torch.Tensor) or t.dim() == 0:
                continue
            rows = shape[0] * k
            if t.shape[0] == rows:
                whole.append(name)
            elif t.shape[0] * n == rows:
                sliced.append(name)
            elif k == 1 and self._global_rows(t, shape):
                raise InputsError(self._micro_batch_error(name, t, shape))
            else:
                raise InputsError(
                    f"{name} has {t.shape[0]} rows; the plan takes {self.accepted(shape, k, True)}: plans are "
                    "specialized to the example inputs' shapes, re-plan for another batch size"
                )
        if whole and sliced:
            raise InputsError(
                f"{', '.join(whole)} {_verb(whole)} the whole batch but {', '.join(sliced)} {_verb(sliced)} this "
                f"rank's slice: pass every input that carries the batch whole, or every one as this rank's slice "
                f"(pmodel.data_world = {n})"
            )
        return n if sliced else 1

    def check_shapes(self, flat: Sequence, sliced: int, k: int = 1) -> None:
        """InputsError, naming the input and the shapes it may have, unless every input of ``flat``
        has the plan's shape: ``k`` of its batches, this rank's slice of those that carry the
        batch where ``sliced`` > 1."""
        for name, t, shape, carries in zip(self.names, flat, self.shapes, self.carries):
            if not isinstance(t, torch.Tensor):
                continue
            want = _rows(shape, shape[0] * k // (sliced if carries else 1)) if shape else shape
            if tuple(t.shape) == want:
                continue
            if k == 1 and self._global_rows(t, shape) and tuple(t.shape[1:]) == shape[1:]:
                raise InputsError(self._micro_batch_error(name, t, shape))
            raise InputsError(
                f"{name} has shape {tuple(t.shape)}; the plan takes {self.accepted(shape, k, carries)}: plans are "
                "specialized to the example inputs' shapes, re-plan for this shape"
            )

    def accepted(self, shape: tuple[int, ...], k: int, carries: bool) -> str:
        """The shapes an input the plan takes as ``shape`` may have, in a call of ``k`` of its batches."""
        whole = _rows(shape, shape[0] * k) if shape else shape
        n = self.data_world
        if not carries or n == 1:
            return f"{whole} on every rank"
        return f"{whole}, the whole batch, or {_rows(shape, shape[0] * k // n)}, this rank's slice (pmodel.data_world = {n})"

    def to_graph(self, flat: Sequence, sliced: int, k: int = 1) -> list:
        """The inputs as the generated graph takes them (module docstring): where each rank was fed
        its slice (``sliced`` > 1), every input that carries the batch and that the data axis does
        not split, gathered whole over the data axis, the slices in ``data_rank`` order; with ``k``
        micro-batches still to be cut from them (a pipeline's schedule cuts them later), in the
        order that makes micro-batch ``i`` the slices' micro-batches ``i``. Collective over the data
        axis of the bound mesh (``collectives.bound_mesh``)."""
        if sliced == 1:
            return list(flat)
        out = []
        for t, carries, axis in zip(flat, self.carries, self.batch_axes):
            if carries and axis != self.data_axis:
                t = C.all_gather(t, 0, self.data_axis)
                if k > 1:
                    t = t.unflatten(0, (sliced, k, -1)).transpose(0, 1).flatten(0, 2)
            out.append(t)
        return out

    def _global_rows(self, t: torch.Tensor, shape: tuple[int, ...]) -> bool:
        """Whether ``t``, given to ``forward`` of a module of several micro-batches whose plan takes
        ``shape``, holds the rows of the global batch (or this rank's slice of it): ``step``'s."""
        k = self.micro_batches
        return (
            k > 1
            and bool(shape)
            and t.dim() > 0
            and t.shape[0] in (shape[0] * k, shape[0] * k // self.data_world)
        )

    def _micro_batch_error(self, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> str:
        return (
            f"{name} has {t.shape[0]} rows, the global batch's, but this module runs the plan's "
            f"{self.micro_batches} micro-batches: forward takes one micro-batch, {shape} (or this rank's slice of "
            "it). Call pmodel.step(...) with the global batch to train (it runs every micro-batch and the backward)"
        )


def _rows(shape: tuple[int, ...], rows: int) -> tuple[int, ...]:
    return (rows, *shape[1:])


def _verb(names: Sequence[str]) -> str:
    return "holds" if len(names) == 1 else "hold"
