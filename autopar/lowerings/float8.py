"""FP8 linears: what a linear chosen FP8 (``autopar.trades.Float8``) casts and reduces, per rank.

A linear ``Y = X W^T (+ b)`` that runs FP8 runs torchao's float8 training matmul on its local
pieces (``codegen/float8.py``): six casts of a high-precision operand to ``float8_e4m3fn``, each
with a dynamic scale ``finfo(e4m3).max / amax``, then three scaled GEMMs (``torch._scaled_mm``),
the bias added after in the high type. The casts, in the order torchao issues them
(``torchao/float8/float8_linear.py:matmul_with_hp_or_float8_args``):

=====  ===========  ========  ==========================================
cast   operand      phase     a rowwise scale reduces over
=====  ===========  ========  ==========================================
0      ``X``        forward   its last dim ``K`` (one scale per row)
1      ``W``        forward   its dim 1, ``K`` (one per output feature)
2      ``dY``       backward  its last dim ``N`` (for ``dX = dY W``)
3      ``W``        backward  its dim 0, ``N`` (one per input feature)
4      ``dY``       backward  its leading dims ``M`` (for ``dW = dY^T X``)
5      ``X``        backward  its leading dims ``M``
=====  ===========  ========  ==========================================

A tensorwise scale reduces over every dim. The rank-local amax is the single device's only where
no mesh axis shards a dim it reduces over; so, that the local pieces are cast exactly as the single
device casts its slices of them, each cast's amax is all-reduced (max) over every mesh axis that
shards one of its reduced dims (``Shard``; a ``Partial`` output's gradient is whole on every rank,
and an op with a ``Partial`` input never runs FP8: a sum of casts is not the cast of the sum):

* calls: one ``ALL_REDUCE`` per (cast, such axis), of the local amax: ``4`` bytes (tensorwise), or
  four per scale (rowwise: one per local row of the operand along the kept dims), in cast order,
  the forward's two casts then the backward's four; none hides behind compute (the GEMM needs
  the scale);
* cast kernels (``cast_elements``): each cast reads its operand twice (the amax, then the scaled
  cast) and writes one byte per element: ``(2 item + 1) E`` bytes and two kernel launches per
  cast, for ``E`` the operand's local elements, memory-bound (priced by
  ``cost_model/compute.py:float8_linear_time``);
* saved bytes: none beyond the traced linear's (torchao saves the high-precision ``X`` and ``W``,
  as a linear does, and casts again in backward).

Which strategies may run FP8 (``describe`` returns None elsewhere): a plain linear (no 2D-matmul
or other ``via`` but a data-parallel region's ``OwnRows``, no ``Partial`` input), a 2-D weight, and local ``K`` and ``N`` that are multiples
of 16 (``torch._scaled_mm``'s alignment on CUDA; torchtitan skips such linears too).

Read by the cost tables (``passes/float8_price.py:float8_price``: the calls through the comm model, the
casts through the compute model) and by codegen (``codegen/lower.py``: the axes of each cast,
``amax_axes``); ``tests/test_float8.py`` checks the all-reduces the generated code issues against
``describe``'s calls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.fx as fx

from autopar.lowerings import Collective, LoweringCall, LoweringPlan, Phase
from autopar.placement import OwnRows, is_partial, is_shard, local_shape
from autopar.trades import Float8

aten = torch.ops.aten
LINEAR = aten.linear.default
ALIGN = 16  # torch._scaled_mm on CUDA: K and N multiples of 16
AMAX_ITEM = 4  # bytes per scale all-reduced (torchao computes amax in the operand's dtype; priced fp32)

# per cast (module docstring's table): (operand: 0 X, 1 W, 2 dY), phase, the dims a rowwise scale
# reduces over ("last", "leading", or a dim index of W)
CASTS: tuple[tuple[int, Phase, str | int], ...] = (
    (0, Phase.FORWARD, "last"),
    (1, Phase.FORWARD, 1),
    (2, Phase.BACKWARD, "last"),
    (1, Phase.BACKWARD, 0),
    (2, Phase.BACKWARD, "leading"),
    (0, Phase.BACKWARD, "leading"),
)


def _val(node: fx.Node, i: int):
    a = node.args[i] if len(node.args) > i else None
    return a.meta.get("val") if isinstance(a, fx.Node) else None


def local_operands(node: fx.Node, s, mesh_shape: Sequence[int]) -> tuple[tuple[int, ...], ...] | None:
    """The local shapes of ``X``, ``W`` and ``Y`` (``dY``'s) under strategy ``s``; None where the
    node is no linear of a 2-D weight or a piece does not divide evenly."""
    if node.op != "call_function" or node.target is not LINEAR:
        return None
    x, w, y = _val(node, 0), _val(node, 1), node.meta.get("val")
    if not all(isinstance(t, torch.Tensor) for t in (x, w, y)) or w.dim() != 2 or x.dim() < 1:
        return None
    if len(s.ins) < 2:
        return None
    try:
        return (
            local_shape(tuple(x.shape), s.ins[0], mesh_shape),
            local_shape(tuple(w.shape), s.ins[1], mesh_shape),
            local_shape(tuple(y.shape), s.out, mesh_shape),
        )
    except ValueError:
        return None


def eligible(node: fx.Node, s, mesh_shape: Sequence[int]) -> bool:
    """Whether ``node`` under ``s`` may run FP8 (module docstring)."""
    # an op of a data-parallel region (``OwnRows``) runs on this rank's rows as traced: FP8 applies
    if any(v is not None and not isinstance(v, OwnRows) for v in getattr(s, "via", ())):
        return False
    if any(is_partial(p) for spec in s.ins for p in spec):
        return False
    shapes = local_operands(node, s, mesh_shape)
    if shapes is None:
        return False
    x, w, _ = shapes
    if not _val(node, 0).dtype.is_floating_point:
        return False
    return w[0] % ALIGN == 0 and w[1] % ALIGN == 0 and x[-1] == w[1]


def _reduced(rule: str | int, ndim: int, recipe: Float8) -> set[int]:
    if recipe is Float8.TENSORWISE:
        return set(range(ndim))
    if rule == "last":
        return {ndim - 1}
    if rule == "leading":
        return set(range(ndim - 1))
    return {int(rule)}


def amax_axes(node: fx.Node, s, recipe: Float8) -> tuple[tuple[int, ...], ...]:
    """Per cast (``CASTS``' order), the mesh axes its amax is all-reduced over."""
    specs = (s.ins[0], s.ins[1], s.out)
    ndims = (_val(node, 0).dim(), 2, node.meta["val"].dim())
    out = []
    for operand, _, rule in CASTS:
        dims = _reduced(rule, ndims[operand], recipe)
        spec = specs[operand]
        out.append(tuple(a for a, p in enumerate(spec) if is_shard(p) and p.dim % ndims[operand] in dims))
    return tuple(out)


def _scales(shape: tuple[int, ...], dims: set[int]) -> int:
    """How many scales a cast of a tensor of local ``shape`` computes: one per index of the dims it
    keeps (1 for a tensorwise cast)."""
    return math.prod(n for d, n in enumerate(shape) if d not in dims)


def describe(node: fx.Node, s, mesh_shape: Sequence[int], recipe: Float8) -> LoweringPlan | None:
    """The calls of ``node`` run FP8 with ``recipe`` under ``s`` (module docstring); None where it
    may not run FP8."""
    if recipe is Float8.OFF or not eligible(node, s, mesh_shape):
        return None
    shapes = local_operands(node, s, mesh_shape)
    calls = []
    for (operand, phase, rule), axes in zip(CASTS, amax_axes(node, s, recipe)):
        shape = shapes[operand]
        n = _scales(shape, _reduced(rule, len(shape), recipe))
        calls.extend(LoweringCall(Collective.ALL_REDUCE, a, float(AMAX_ITEM * n), phase) for a in axes)
    return LoweringPlan(tuple(calls))


def cast_elements(node: fx.Node, s, mesh_shape: Sequence[int]) -> tuple[tuple[float, Phase], ...]:
    """Per cast, the local elements it reads and its phase (``cost_model/compute.py`` prices them)."""
    shapes = local_operands(node, s, mesh_shape)
    if shapes is None:
        return ()
    return tuple((float(math.prod(shapes[operand])), phase) for operand, phase, _ in CASTS)
