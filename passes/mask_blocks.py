"""Masks too large to hold: an elementwise value kept as the expression that computes it, compared
with the causal mask one block of query rows at a time.

A Hugging Face causal mask of a 128K-token sequence is a ``(batch, 1, L, S)`` boolean of 16 GiB per
batch row as written, while everything it is computed from is a vector (positions as ``(b, 1, L,
1)`` and ``(b, 1, 1, S)``): only its last few ops, elementwise comparisons and ``&`` broadcast
over both, make it ``L x S``. :mod:`autopar.passes.causal_mask` evaluates the mask op by op within
a budget; an op that would take it past the budget, and every op after it that reads its result,
is kept here as a :class:`Lazy` value instead, if it is one of

- an elementwise op (``Tag.pointwise``, or a dtype conversion such as ``to``): element ``x`` of the
  result depends only on element ``x`` of each input broadcast to its shape;
- a view that only broadcasts or adds/removes size-1 dims (``expand``, ``unsqueeze``, ``squeeze``,
  a ``view`` of the same sizes but ones): element ``x`` is an input's element at the matching index;
- ``tril``/``triu``: element ``(..., i, j)`` is the input's, or 0 where ``j - i > d`` (``< d``).

Each of these commutes with taking a block of its result: rows ``r0 .. r0+n`` of the result are the
op applied to those rows of every input that has them (an input broadcast along the dim, size 1,
is taken whole), and for ``tril``/``triu`` the block at rows ``r0`` and columns ``c0`` is the
input's block with diagonal ``d + r0 - c0``. :meth:`Lazy.narrow` rewrites the expression so, down
to its leaves (tensors held by the evaluation, narrowed as views), and :meth:`Lazy.materialize`
computes a block. :func:`causal_blockwise` then proves the mask causal exactly as
``is_causal_mask`` does for a held tensor, block by block: every element is computed and compared
with ``C[i, j] = j <= i``, one slice per leading dim that every leaf broadcasts, every index of a
leading dim some leaf really holds. Any other op reading a lazy value is not evaluated (the mask
is left as it is), so nothing is ever assumed.

Memory: a block of ``n`` rows holds at most ``n * S`` elements per node of the expression (each
node's block counted as if alive at once) plus the comparison's temporaries
(``COMPARE_BYTES_PER_ELEMENT``), and the leaves, held anyway; ``n`` is the most rows for which that
fits the budget, and a budget that cannot hold one row refuses.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
import torch.utils._pytree as pytree

_aten = torch.ops.aten
# conversions whose element x depends only on the input's element x (not tagged pointwise by torch)
CONVERSIONS = {
    _aten.to.dtype,
    _aten.to.dtype_layout,
    _aten.to.device,
    _aten._to_copy.default,
    _aten.alias.default,
    _aten.detach.default,
    _aten.lift_fresh_copy.default,
}
# the bitwise operators torch does not tag pointwise (their ``bitwise_*`` ops are)
BITWISE_ALIASES = {
    getattr(getattr(_aten, f"__{op}__"), o) for op in ("and", "or", "xor") for o in ("Tensor", "Scalar")
}
VIEWS = {
    _aten.expand.default,
    _aten.unsqueeze.default,
    _aten.squeeze.default,
    _aten.squeeze.dim,
    _aten.squeeze.dims,
    _aten.view.default,
    _aten.reshape.default,
    _aten._unsafe_view.default,
}
TRIANGLES = {_aten.tril.default: False, _aten.triu.default: True}  # op -> upper
# bytes per element a block's comparison holds beyond the block's own values (the causal block, the
# float mask's ``== 0``, ``== -inf``, ``<= min`` and their combinations)
COMPARE_BYTES_PER_ELEMENT = 8


# ops filling a new tensor of the size they are given with one value -> the index of that size
FILLS = {
    _aten.zeros.default: 0,
    _aten.ones.default: 0,
    _aten.full.default: 0,
    _aten.new_zeros.default: 1,
    _aten.new_ones.default: 1,
    _aten.new_full.default: 1,
}


def constant_fill(target, args, kwargs) -> torch.Tensor | None:
    """A fill too large to hold as a broadcast of one element (the same value at every index);
    None for any other op."""
    at = FILLS.get(target)
    if at is None or len(args) <= at:
        return None
    size = list(args[at])
    one = list(args)
    one[at] = [1] * len(size)
    return target(*one, **kwargs).expand(size)


class NotBlockwise(Exception):
    """The op cannot be kept as a lazy value: its block is not the op of its inputs' blocks."""


class Lazy:
    """A value too large to hold, as the expression computing it; ``shape`` and ``dtype`` its own."""

    shape: torch.Size
    dtype: torch.dtype

    def narrow(self, dim: int, start: int, length: int) -> Lazy:
        """The expression of ``value.narrow(dim, start, length)``."""
        raise NotImplementedError

    def materialize(self) -> torch.Tensor:
        raise NotImplementedError

    def children(self) -> list:
        raise NotImplementedError

    def nodes(self) -> Iterator[Lazy]:
        yield self
        for c in self.children():
            if isinstance(c, Lazy):
                yield from c.nodes()

    def leaves(self) -> Iterator[torch.Tensor]:
        for n in self.nodes():
            yield from (c for c in n.children() if isinstance(c, torch.Tensor))

    def varies(self, dim: int) -> bool:
        """Whether the value may differ along ``dim``: some leaf really holds that dim (size > 1,
        stride not 0); False proves every slice along it equal to the first."""
        raise NotImplementedError


def _narrow_aligned(value, ndim: int, dim: int, start: int, length: int):
    """``value`` (an operand broadcast, aligned right, to ``ndim`` dims) narrowed along ``dim``."""
    if not isinstance(value, (torch.Tensor, Lazy)):
        return value
    e = dim - (ndim - len(value.shape))
    if e < 0 or value.shape[e] == 1:  # broadcast along it: every block reads it whole
        return value
    return value.narrow(e, start, length)


def _varies_aligned(value, ndim: int, dim: int) -> bool:
    if not isinstance(value, (torch.Tensor, Lazy)):
        return False
    e = dim - (ndim - len(value.shape))
    if e < 0 or value.shape[e] == 1:
        return False
    if isinstance(value, Lazy):
        return value.varies(e)
    return value.stride(e) != 0


def _materialize(value):
    return value.materialize() if isinstance(value, Lazy) else value


def _narrowed_shape(shape, dim: int, length: int) -> torch.Size:
    return torch.Size((*shape[:dim], length, *shape[dim + 1 :]))


class Elementwise(Lazy):
    """``target(*args, **kwargs)`` of an elementwise op over operands broadcast to ``shape``."""

    def __init__(self, target, flat: list, spec, shape, dtype):
        self.target, self.flat, self.spec = target, flat, spec
        self.shape, self.dtype = torch.Size(shape), dtype

    def children(self) -> list:
        return self.flat

    def narrow(self, dim, start, length):
        n = len(self.shape)
        flat = [_narrow_aligned(a, n, dim, start, length) for a in self.flat]
        return Elementwise(self.target, flat, self.spec, _narrowed_shape(self.shape, dim, length), self.dtype)

    def materialize(self):
        args, kwargs = pytree.tree_unflatten([_materialize(a) for a in self.flat], self.spec)
        out = self.target(*args, **kwargs)
        if tuple(out.shape) != tuple(self.shape):  # never expected: refused, not broadcast on trust
            raise NotBlockwise(f"{self.target} gave {tuple(out.shape)}, its block is {tuple(self.shape)}")
        return out

    def varies(self, dim):
        return any(_varies_aligned(a, len(self.shape), dim) for a in self.flat)


class View(Lazy):
    """``inner`` with size-1 dims added or removed and broadcast to ``shape``: output dim ``d`` is
    ``inner``'s dim ``dims[d]`` (None: a new dim, broadcast)."""

    def __init__(self, inner, dims: tuple, shape):
        self.inner, self.dims, self.shape, self.dtype = inner, tuple(dims), torch.Size(shape), inner.dtype

    def children(self) -> list:
        return [self.inner]

    def narrow(self, dim, start, length):
        e, inner = self.dims[dim], self.inner
        if e is not None and inner.shape[e] != 1:
            inner = inner.narrow(e, start, length)
        return View(inner, self.dims, _narrowed_shape(self.shape, dim, length))

    def materialize(self):
        x = _materialize(self.inner)
        kept = [x.shape[e] if e is not None else 1 for e in self.dims]
        return x.reshape(kept).expand(self.shape)

    def varies(self, dim):
        e = self.dims[dim]
        return _varies_aligned(self.inner, len(self.inner.shape), e) if e is not None else False

    @staticmethod
    def of(inner, shape) -> View:
        """The view of ``inner`` (a tensor or lazy value) as ``shape``; ``NotBlockwise`` where it
        moves more than size-1 dims (a real reshape)."""
        shape = torch.Size(shape)
        src = list(inner.shape)
        if len(shape) >= len(src) and all(
            s == o or s == 1 for s, o in zip(src, shape[len(shape) - len(src) :], strict=True)
        ):  # aligned right: an expand (or the same shape)
            off = len(shape) - len(src)
            return View(inner, [d - off if d >= off else None for d in range(len(shape))], shape)
        # a view adding or removing size-1 dims: the other sizes, in order, match one to one
        big = [d for d, s in enumerate(src) if s != 1]
        out = [d for d, s in enumerate(shape) if s != 1]
        if [src[d] for d in big] != [shape[d] for d in out] or shape.numel() != torch.Size(src).numel():
            raise NotBlockwise(f"a view of {tuple(src)} as {tuple(shape)}")
        dims: list = [None] * len(shape)
        for d, e in zip(out, big, strict=True):
            dims[d] = e
        return View(inner, dims, shape)


class Triangle(Lazy):
    """``inner.tril(diagonal)`` (``triu`` where ``upper``): the last two dims are rows and columns."""

    def __init__(self, inner, diagonal: int, upper: bool):
        self.inner, self.diagonal, self.upper = inner, diagonal, upper
        self.shape, self.dtype = torch.Size(inner.shape), inner.dtype

    def children(self) -> list:
        return [self.inner]

    def narrow(self, dim, start, length):
        n = len(self.shape)
        d = self.diagonal + (start if dim == n - 2 else -start if dim == n - 1 else 0)
        return Triangle(_narrow_aligned(self.inner, n, dim, start, length), d, self.upper)

    def materialize(self):
        x = _materialize(self.inner)
        return x.triu(self.diagonal) if self.upper else x.tril(self.diagonal)

    def varies(self, dim):
        n = len(self.shape)
        return dim >= n - 2 or _varies_aligned(self.inner, n, dim)


def lazy_call(target, args, kwargs, out_meta: torch.Tensor) -> Lazy:
    """``target(*args, **kwargs)`` kept lazy (``out_meta``: its result run on meta tensors);
    ``NotBlockwise`` where the op is none of the module docstring's."""
    if target in VIEWS:
        return View.of(args[0], out_meta.shape)
    if target in TRIANGLES:
        diagonal = args[1] if len(args) > 1 else kwargs.get("diagonal", 0)
        return Triangle(args[0], int(diagonal), TRIANGLES[target])
    if (
        target in CONVERSIONS
        or torch.Tag.pointwise in getattr(target, "tags", ())
        or target in BITWISE_ALIASES
    ):
        flat, spec = pytree.tree_flatten((args, kwargs))
        return Elementwise(target, flat, spec, out_meta.shape, out_meta.dtype)
    raise NotBlockwise(f"{target} is not elementwise")


def matches_causal(m: torch.Tensor, causal: torch.Tensor) -> bool:
    """Whether ``m`` (rows x cols, or broadcast leading dims in front) attends exactly where
    ``causal`` is True: True attends in a boolean mask; 0 attends and ``-inf`` (or at most the
    dtype's lowest finite value) masks in a float one."""
    if m.dtype == torch.bool:
        return bool((m == causal).all())
    masked = (m == float("-inf")) | (m <= torch.finfo(m.dtype).min)
    return bool(((m == 0) == causal).all() and (masked == ~causal).all())


def block_rows(mask: Lazy, cols: int, budget: float) -> int:
    """The most query rows a block of ``mask`` may have within ``budget`` (module docstring); 0
    where not one row fits."""
    held = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in mask.leaves()}
    per_element = sum(n.dtype.itemsize for n in mask.nodes()) + COMPARE_BYTES_PER_ELEMENT
    return max(0, int((budget - sum(held.values())) // (cols * per_element)))


def causal_blockwise(mask: Lazy, rows: int, cols: int, budget: float, diagonals=None) -> bool:
    """Whether ``mask``, broadcast to ``(..., rows, cols)``, is SDPA's ``is_causal`` mask at every
    index, computed and compared ``block_rows`` query rows at a time. ``diagonals(slice, rows,
    cols)``, where given, may instead return a slice's value on each diagonal ``j - i`` (its
    ``rows + cols - 1`` elements, ``passes/mask_diagonals.py``), compared with ``d <= 0``."""
    if not (mask.dtype == torch.bool or mask.dtype.is_floating_point) or len(mask.shape) < 2:
        return False
    if any(s not in (1, want) for s, want in zip(mask.shape[-2:], (rows, cols), strict=True)):
        return False
    if rows < 1 or cols < 1 or any(s < 1 for s in mask.shape):  # nothing to compare: not proven
        return False
    try:
        return _causal_blockwise(mask, rows, cols, budget, diagonals)
    except Exception:  # noqa: BLE001 - a block that cannot be computed: not proven, left as it is
        return False


def _causal_blockwise(mask: Lazy, rows: int, cols: int, budget: float, diagonals) -> bool:
    m = View.of(mask, (*mask.shape[:-2], rows, cols)) if mask.shape[-2:] != (rows, cols) else mask
    lead = len(m.shape) - 2
    # one slice of a leading dim no leaf holds (every slice equal), each index of one a leaf holds
    indices = [range(m.shape[d]) if m.varies(d) else range(1) for d in range(lead)]
    step = block_rows(m, cols, budget)
    if step < 1:
        return False
    for index in itertools.product(*indices):
        one = m
        for d, i in enumerate(index):
            one = one.narrow(d, i, 1)
        g = diagonals(one, rows, cols) if diagonals is not None else None
        if g is not None:
            if not matches_causal(g, torch.arange(-(rows - 1), cols) <= 0):
                return False
            continue
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            block = one.narrow(lead, r0, n).materialize().reshape(n, cols)
            causal = torch.arange(cols)[None, :] <= torch.arange(r0, r0 + n)[:, None]
            if not matches_causal(block, causal):
                return False
    return True
