"""A lazy mask that depends on ``j - i`` alone: proven causal from one vector over the diagonals.

:func:`autopar.passes.mask_blocks.causal_blockwise` computes every element of an ``L x S`` mask:
17 G elements at 128K tokens, over a minute of CPU. A causal mask as models build it is a function
of the diagonal ``d = j - i`` alone (``key_pos <= query_pos`` with positions ``i + c`` and
``j + c``), and such a value is known everywhere from its value at each diagonal,
``d = -(L-1) .. S-1``: ``L + S - 1`` elements. This module computes that vector exactly, where it
can show the value is such a function, by abstract interpretation of the lazy expression (one
slice of its leading dims, as ``causal_blockwise`` takes them):

- a leaf (a held tensor) constant along the rows and columns (sizes 1 or stride 0) is that
  constant; an integer leaf varying along one of them only is checked, element by element, to be
  ``a * i + c`` (or ``b * j + c``): an :class:`Affine` form ``a*i + b*j + c``;
- ``add``/``sub``/``neg`` of affine forms and ``mul`` by an integer constant are affine (Python
  integers: exact), and an integer comparison of two forms (``le lt ge gt eq ne``) is the same
  comparison of their difference with 0; where that difference has ``a = -b`` it is ``b*d + c``, a
  function of ``d``, and the comparison is computed on the vector ``b*d + c`` for every ``d``
  (refused where ``|b*d| + |c|`` could reach 2**62, so int64 never overflows);
- any other elementwise op whose operands are all functions of ``d`` is run on their vectors (an
  operand constant everywhere as a one-element vector, so type promotion is the op's own), and
  ``tril(x, k)`` keeps ``x`` where ``d <= k`` (``triu``: ``d >= k``), where its own rows and
  columns are the mask's (not broadcast);
- anything else (a leaf varying along both dims, a boolean or float leaf varying along one, a form
  with ``a != -b`` reaching a non-comparison, a view that moves the last two dims) is refused:
  ``None``, and ``causal_blockwise`` computes the elements.

The result is then exactly the mask's value at every ``(i, j)``: element ``(i, j)`` of each node
is its vector's element at ``d = j - i``, by induction over the expression, and every ``d`` of the
range is some ``(i, j)``'s, so comparing the vector with ``d <= 0`` is comparing the mask with
``tril``.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.utils._pytree as pytree

from autopar.passes.mask_blocks import Elementwise, Lazy, Triangle, View

_aten = torch.ops.aten
_COMPARE = {
    _aten.le: operator.le,
    _aten.lt: operator.lt,
    _aten.ge: operator.ge,
    _aten.gt: operator.gt,
    _aten.eq: operator.eq,
    _aten.ne: operator.ne,
}
_ADD = {_aten.add.Tensor, _aten.add.Scalar}
_SUB = {_aten.sub.Tensor, _aten.sub.Scalar, _aten.rsub.Tensor, _aten.rsub.Scalar}
_MUL = {_aten.mul.Tensor, _aten.mul.Scalar}
_NEG = {_aten.neg.default}
LIMIT = 2**62
_SIGNED = (torch.int8, torch.int16, torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True)
class Affine:
    """``a*i + b*j + c`` at row ``i``, column ``j`` (exact Python integers), of ``dtype`` (None:
    a Python integer or a 0-dim tensor, which takes a dimensioned operand's integer dtype)."""

    a: int
    b: int
    c: int
    dtype: torch.dtype | None

    def __add__(self, o: Affine) -> Affine:
        if self.dtype is None or o.dtype is None:
            dtype = self.dtype or o.dtype
        else:
            dtype = torch.promote_types(self.dtype, o.dtype)
        return Affine(self.a + o.a, self.b + o.b, self.c + o.c, dtype)

    def scaled(self, k: int) -> Affine:
        return Affine(self.a * k, self.b * k, self.c * k, self.dtype)


class _Refused(Exception):
    pass


def diagonal_vector(mask: Lazy, rows: int, cols: int) -> torch.Tensor | None:
    """``g`` with ``mask[..., i, j] == g[j - i + rows - 1]`` at every index (one slice of the
    leading dims: every leading dim of ``mask`` of size 1), or None where not shown so."""
    d = torch.arange(-(rows - 1), cols)
    try:
        g = _vector(_eval(mask, rows, cols), d)
    except _Refused:
        return None
    return g.expand(len(d))


def _eval(x, rows: int, cols: int):
    """``x``'s abstract value: an :class:`Affine` form, a 1-D vector over ``d`` (one element where
    constant), or a Python scalar; ``_Refused`` where none holds."""
    if not isinstance(x, (torch.Tensor, Lazy)):
        return x  # a Python scalar, a dtype, a layout...
    if isinstance(x, torch.Tensor):
        return _leaf(x, rows, cols)
    if isinstance(x, Triangle):
        if tuple(x.shape[-2:]) != (rows, cols):  # its rows or columns broadcast: i or j is not its own
            raise _Refused
        d = _diagonals(rows, cols)
        g = _vector(_eval(x.inner, rows, cols), d)
        keep = d >= x.diagonal if x.upper else d <= x.diagonal
        return torch.where(keep, g, torch.zeros((), dtype=g.dtype))
    if isinstance(x, View):
        n, m = len(x.shape), len(x.inner.shape)
        for out, inner in ((n - 1, m - 1), (n - 2, m - 2)):
            if out >= 0 and x.shape[out] != 1 and (inner < 0 or x.dims[out] != inner):
                raise _Refused  # the rows or columns moved
        return _eval(x.inner, rows, cols)
    if isinstance(x, Elementwise):
        return _elementwise(x, rows, cols)
    raise _Refused


def _diagonals(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(-(rows - 1), cols)


def _leaf(t: torch.Tensor, rows: int, cols: int):
    """A held tensor's abstract value (module docstring)."""
    if t.dim() == 0:
        return t  # a 0-dim operand keeps its own type promotion
    lead = t.shape[:-2] if t.dim() > 2 else ()
    if any(s != 1 for s in lead):
        raise _Refused
    t2 = t.reshape(t.shape[-2:] if t.dim() >= 2 else (1, t.shape[-1]))
    along = [t2.shape[k] > 1 and t2.stride(k) != 0 for k in (0, 1)]
    if not any(along):
        return t2.reshape(-1)[:1]  # one value everywhere: a one-element vector
    if t.dtype not in _SIGNED or all(along):
        raise _Refused
    v = (t2[:, 0] if along[0] else t2[0, :]).to(torch.int64)
    step, first = int(v[1] - v[0]), int(v[0])
    if not torch.equal(v, first + step * torch.arange(len(v))):
        raise _Refused
    form = Affine(step, 0, first, t.dtype) if along[0] else Affine(0, step, first, t.dtype)
    return _bounded(form, rows, cols)


def _affine(v) -> Affine:
    """An integer operand as an affine form; ``_Refused`` where it is not one."""
    if isinstance(v, Affine):
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return Affine(0, 0, v, None)
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.dtype in _SIGNED:
        return Affine(0, 0, int(v.reshape(())), v.dtype if v.dim() else None)
    raise _Refused


def _bounded(v: Affine, rows: int, cols: int) -> Affine:
    """``v``, refused where its values could overflow its dtype (the tensor ops wrap, the form
    does not): ``|a|*(rows-1) + |b|*(cols-1) + |c|`` under half the dtype's largest value."""
    top = torch.iinfo(v.dtype or torch.int64).max // 2
    if abs(v.a) * (rows - 1) + abs(v.b) * (cols - 1) + abs(v.c) >= top:
        raise _Refused
    return v


def _vector(v, d: torch.Tensor) -> torch.Tensor:
    """``v`` as a vector over the diagonals ``d`` (or one element where constant)."""
    if isinstance(v, Affine):
        if v.a != -v.b or v.dtype is None or abs(v.b) * int(d.abs().max()) + abs(v.c) >= LIMIT:
            raise _Refused
        return (v.b * d + v.c).to(v.dtype) if v.b else torch.full((1,), v.c, dtype=v.dtype)
    if isinstance(v, torch.Tensor):
        return v if v.dim() else v.reshape(1)
    raise _Refused


def _elementwise(x: Elementwise, rows: int, cols: int):
    args, kwargs = pytree.tree_unflatten([_eval(a, rows, cols) for a in x.flat], x.spec)
    target = x.target
    if isinstance(target, torch._ops.OpOverload) and any(isinstance(a, Affine) for a in args):
        packet = target.overloadpacket
        if packet in _COMPARE and len(args) == 2 and not kwargs:
            diff = _affine(args[0]) + _affine(args[1]).scaled(-1)
            diff = Affine(diff.a, diff.b, diff.c, torch.int64)  # exact: no tensor op computes it
            return _checked(_COMPARE[packet](_vector(diff, _diagonals(rows, cols)), 0), x)
        if target in _ADD | _SUB and len(args) == 2 and set(kwargs) <= {"alpha"}:
            alpha = kwargs.get("alpha", 1)
            if not isinstance(alpha, int) or isinstance(alpha, bool):
                raise _Refused
            first, second = _affine(args[0]), _affine(args[1])
            if target in _ADD:  # self + alpha * other
                return _bounded(first + second.scaled(alpha), rows, cols)
            if target in (_aten.rsub.Tensor, _aten.rsub.Scalar):  # other - alpha * self
                return _bounded(second + first.scaled(-alpha), rows, cols)
            return _bounded(first + second.scaled(-alpha), rows, cols)
        if target in _NEG and len(args) == 1 and not kwargs:
            return _bounded(_affine(args[0]).scaled(-1), rows, cols)
        if target in _MUL and len(args) == 2 and not kwargs:
            p, q = _affine(args[0]), _affine(args[1])
            if p.a == p.b == 0:
                return _bounded(q.scaled(p.c) + Affine(0, 0, 0, p.dtype), rows, cols)
            if q.a == q.b == 0:
                return _bounded(p.scaled(q.c) + Affine(0, 0, 0, q.dtype), rows, cols)
            raise _Refused
    d = _diagonals(rows, cols)

    def as_vector(a):
        return _vector(a, d) if isinstance(a, (Affine, torch.Tensor)) and not _zero_dim(a) else a

    args, kwargs = pytree.tree_map(as_vector, (args, kwargs), is_leaf=lambda a: isinstance(a, Affine))
    return _checked(target(*args, **kwargs), x)


def _zero_dim(a) -> bool:
    return isinstance(a, torch.Tensor) and a.dim() == 0


def _checked(g, x: Lazy) -> torch.Tensor:
    """The op's vector, refused unless it is one (or one element) of the node's own dtype."""
    if not isinstance(g, torch.Tensor) or g.dim() != 1 or g.dtype != x.dtype:
        raise _Refused
    return g
