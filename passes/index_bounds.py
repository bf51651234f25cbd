"""The range of values an integer tensor may hold where ops use it to index another tensor.

A check that runs ops on made-up values (``passes/data_region.py``) must draw each index below the
size of the dim it indexes: a ``scatter_`` over one group takes only index 0. Which argument
indexes which dim is read off the op's schema, by the names ATen gives its arguments, never off
the op's name:

* ``index`` with ``dim`` (``gather``, ``scatter``, ``index_select``, ``index_add``, ...): dim
  ``dim`` of ``self``;
* ``indices`` with ``dim`` (``take_along_dim``): dim ``dim`` of ``self``, or every element of it
  where ``dim`` is None;
* ``indices``, a list (``index``, ``index_put``): its k-th tensor indexes dim k of ``self``;
* ``indices`` with ``weight`` (``embedding``, ``embedding_bag``): the rows of ``weight``.

Where the indexed dim has the batch's rows and a check runs each rank on its own rows, the size is
a rank's (``parts``: the ranks the rows are cut into; ``rows[name]``: the dim of value ``name``
that has them).

A value read through ops that keep its values (views, reshapes, copies, dtype casts between
integers) is bounded by every use of what it becomes. The bound is the least over all such uses.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
import torch.fx as fx

from autopar.passes.rules import ALIASING_OPS

aten = torch.ops.aten

# ops whose output holds their first input's values (in another shape or memory, or as another
# integer dtype): an index read through them is an index still
_KEEPS_VALUES = ALIASING_OPS | {
    aten.reshape.default, aten.clone.default, aten.contiguous.default, aten.flatten.using_ints,
    aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.lift_fresh_copy.default,
}  # fmt: skip


def _shape(a, rows: Mapping[str, object], parts: int) -> tuple[int, ...] | None:
    """``a``'s shape as one rank holds it: its rows' dim cut into ``parts``."""
    v = a.meta.get("val") if isinstance(a, fx.Node) else None
    if not isinstance(v, torch.Tensor):
        return None
    d = rows.get(a.name)
    return tuple(int(s) // parts if i == d else int(s) for i, s in enumerate(v.shape))


def _bound_in(user: fx.Node, value: fx.Node, rows: Mapping[str, object], parts: int) -> int | None:
    """The values ``value`` may take as an argument of ``user`` (indices in [0, bound)), or None
    where ``user`` does not index with it."""
    schema = getattr(user.target, "_schema", None)
    if user.op != "call_function" or schema is None:
        return None
    bound = dict(zip((f.name for f in schema.arguments), user.args))
    bound.update(user.kwargs)
    me = next((k for k, v in bound.items() if v is value), None)
    if me is None:
        listed = bound.get("indices")
        if isinstance(listed, (list, tuple)) and value in listed:
            shape = _shape(bound.get("self"), rows, parts)
            k = list(listed).index(value)
            return shape[k] if shape is not None and k < len(shape) else None
        return None
    if me == "index" or (me == "indices" and "dim" in bound and "self" in bound):
        shape = _shape(bound.get("self"), rows, parts)
        dim = bound.get("dim")
        if shape is None:
            return None
        if dim is None:
            return math.prod(shape)
        return shape[dim % len(shape)] if shape else 1
    if me == "indices" and "weight" in bound:
        shape = _shape(bound["weight"], rows, parts)
        return shape[0] if shape else None
    return None


def index_bound(
    value: fx.Node,
    within: Iterable[str] | None = None,
    rows: Mapping[str, object] | None = None,
    parts: int = 1,
) -> int | None:
    """The least size of a dim that ``value`` (an integer tensor) indexes, directly or through
    ops that keep its values (module docstring), among users named in ``within`` (every user if
    None), a dim with rows (``rows``) counted as one of ``parts`` ranks holds it; None where
    nothing indexes with it."""
    rows = rows or {}
    names = None if within is None else set(within)
    found: int | None = None
    stack, seen = [value], {value.name}
    while stack:
        node = stack.pop()
        for user in node.users:
            if names is not None and user.name not in names:
                continue
            b = _bound_in(user, node, rows, parts)
            if b is not None:
                found = b if found is None else min(found, b)
            if user.target in _KEEPS_VALUES and user.args and user.args[0] is node and user.name not in seen:
                seen.add(user.name)
                stack.append(user)
    return found
