r"""A mixture-of-experts layer's experts as one op: route, grouped MLPs, weighted combine.

``torch.ops.autopar.moe_experts(x, weights, ids, w_in, w_up, w_out, act, gated, transposed,
num_experts, first_expert=0) -> out``: ``x`` ``[T, H]``, the router's ``weights`` ``[T, k]`` (float)
and ``ids`` ``[T, k]`` (int64 in ``[0, num_experts)``). The op holds experts ``first_expert ..
first_expert + E - 1``, ``E = w_in.shape[0]`` (the whole layer: ``E = num_experts``,
``first_expert = 0``). With ``e(t, j) = ids[t, j]``:

.. math::

    \mathrm{out}[t] = \sum_{j=0}^{k-1} [\,f \le e(t,j) < f + E\,]\ \mathrm{weights}[t, j]\,
    \mathrm{expert}_{e(t,j)}(x[t])

summed in that order of ``j`` (as Hugging Face's ``grouped_mm_experts_forward``: the weighted rows
put back in ``[T, k, H]`` order and summed over dim 1), in ``x``'s dtype; the matmuls run in
``w_in``'s dtype. A pair routed outside the op's experts contributes nothing, so over ranks that
each hold a block of the experts the outputs are summands of the layer's output (Partial).

The expert (``transposed``: Hugging Face's storage, ``w_in`` ``[E, F, H]`` used as ``x w_in[e]^T``,
``w_out`` ``[E, H, I]`` as ``h w_out[e]^T``; else ``w_in`` ``[E, H, F]``, ``w_out`` ``[E, I, H]``):

* gated, no ``w_up`` (packed, ``F = 2I``): ``y = x w_in``, ``h = act(y[:, :I]) * y[:, I:]``
  (``chunk(2, -1)``: the gate first);
* gated with ``w_up`` (``F = I``): ``h = act(x w_in) * (x w_up)``;
* not gated (``F = I``): ``h = act(x w_in)``;

then ``expert(x) = h w_out``; ``act`` one of ``Act``'s values.

Composition. The op is registered ``CompositeImplicitAutograd``: it runs as its pieces, so eager
calls record autograd on them and fake or meta calls run their fake implementations; nothing here
has a data-dependent shape. ``route``: a stable ``sort`` of the flat ids (those outside the op's
experts keyed past the last local expert, so they sort to the end), counts per local expert by
``scatter_add`` (a static ``E + 1`` bins); the rows gathered in that order, ``P = T k`` of them
(pairs outside the op's experts included: ``grouped_mm`` leaves rows past the last offset zero and
costs them nothing on the loop path). ``experts_mlp``: two or three ``autopar::grouped_mm`` calls.
``combine``: weight each row, invert the permutation, sum over ``k``. FLOPs under
``FlopCounterMode`` are the grouped GEMMs': ``2 P H F`` (twice with ``w_up``) ``+ 2 P I H``.
``codegen/experts.py`` reuses the three pieces with an all-to-all between them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from autopar.kernels.grouped_mm import grouped_mm


class Act(enum.Enum):
    """The experts' activation, by the name the op's schema carries."""

    SILU = "silu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    RELU = "relu"

    @classmethod
    def of(cls, name: str | Act) -> Act:
        if isinstance(name, Act):
            return name
        try:
            return cls(name)
        except ValueError:
            raise ValueError(
                f"moe_experts: act={name!r} is not one of {', '.join(a.value for a in cls)}"
            ) from None

    def __call__(self, t: Tensor) -> Tensor:
        if self is Act.SILU:
            return F.silu(t)
        if self is Act.GELU:
            return F.gelu(t)
        if self is Act.GELU_TANH:
            return F.gelu(t, approximate="tanh")
        return F.relu(t)


@dataclass(frozen=True)
class Routing:
    """The ``(t, j)`` pairs grouped by local expert.

    ``order`` ``[P]``: flat pair indices (``t k + j``), the pairs of local expert 0 first, then 1,
    ..., each in token order; the pairs outside the local experts last. ``counts`` ``[E]`` int64:
    the pairs of each local expert (``order``'s first ``counts.sum()`` entries are local)."""

    order: Tensor
    counts: Tensor


def route(ids: Tensor, num_experts: int, first_expert: int, experts: int) -> Routing:
    """Group the pairs of ``ids`` ``[T, k]`` (ids in ``[0, num_experts)``) by local expert
    ``ids - first_expert`` in ``[0, experts)``."""
    if not 0 <= first_expert <= num_experts - experts:
        raise ValueError(
            f"route: local experts {first_expert}..{first_expert + experts - 1} are not among the layer's "
            f"{num_experts}"
        )
    flat = ids.reshape(-1)
    local = flat - first_expert
    outside = (local < 0) | (local >= experts)
    key = torch.where(outside, torch.full_like(local, experts), local)
    order = torch.sort(key, stable=True).indices
    bins = torch.zeros(experts + 1, dtype=torch.int64, device=ids.device)
    counts = bins.scatter_add(0, key, torch.ones_like(key))[:experts]
    return Routing(order, counts)


def _as_used(w: Tensor, transposed: bool) -> Tensor:
    """``w`` as the ``[E, in, out]`` operand of ``grouped_mm`` (a view where ``transposed``)."""
    return w.transpose(-2, -1) if transposed else w


def experts_mlp(
    rows: Tensor,
    counts: Tensor,
    w_in: Tensor,
    w_up: Tensor | None,
    w_out: Tensor,
    act: str | Act,
    gated: bool,
    transposed: bool,
) -> Tensor:
    """Each local expert's MLP on its rows: ``rows`` ``[R, H]`` grouped by local expert (``counts``
    ``[E]`` of them in turn; rows past ``counts.sum()`` give zeros) -> ``[R, H]`` in ``w_in``'s dtype."""
    fn = Act.of(act)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = rows.to(w_in.dtype)
    y = grouped_mm(rows, _as_used(w_in, transposed), offs)
    if not gated:
        h = fn(y)
    elif w_up is None:
        gate, up = y.chunk(2, dim=-1)
        h = fn(gate) * up
    else:
        h = fn(y) * grouped_mm(rows, _as_used(w_up, transposed), offs)
    return grouped_mm(h, _as_used(w_out, transposed), offs)


def combine(out_rows: Tensor, order: Tensor, weights: Tensor, dtype: torch.dtype) -> Tensor:
    """The layer's output ``[T, H]`` in ``dtype`` from ``out_rows`` ``[T k, H]``, row ``i`` the
    expert output of pair ``order[i]``: each row times its pair's weight, put back in pair order,
    ``view(T, k, H).sum(1)`` (Hugging Face's order of the sum)."""
    tokens, k = weights.shape
    weighted = out_rows * weights.reshape(-1)[order].unsqueeze(-1)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return weighted[inverse].view(tokens, k, out_rows.shape[-1]).sum(1).to(dtype)


class MoeOperands(NamedTuple):
    """The arguments of ``moe_experts``, in its schema's order (the schema is written from these
    fields, ``_schema``): the one list of them that the op, its checks and the expert-parallel
    forms (``codegen/experts.py``, ``codegen/experts_nodes.py``) read. A NamedTuple so that an FX
    graph can carry it as one argument whose fields are nodes (``codegen/lower.py``)."""

    x: Tensor
    weights: Tensor
    ids: Tensor
    w_in: Tensor
    w_up: Tensor | None
    w_out: Tensor
    act: str | Act
    gated: bool
    transposed: bool
    num_experts: int
    first_expert: int = 0


# each field's annotation (written as a string: ``from __future__ import annotations``; NamedTuple
# keeps it as a ForwardRef) -> its schema type
_SCHEMA_TYPES = {
    "Tensor": "Tensor",
    "Tensor | None": "Tensor?",
    "str | Act": "str",
    "bool": "bool",
    "int": "int",
}


def _schema() -> str:
    """``moe_experts``'s argument list in ``torch.library`` schema syntax, from ``MoeOperands``."""
    defaults = MoeOperands._field_defaults
    return ", ".join(
        f"{_SCHEMA_TYPES[getattr(kind, '__forward_arg__', kind)]} {name}"
        + (f"={defaults[name]}" if name in defaults else "")
        for name, kind in MoeOperands.__annotations__.items()
    )


def check(op: MoeOperands) -> None:
    """Raise ``ValueError`` naming what disagrees in the operands of ``moe_experts``."""
    x, weights, ids, w_in, w_up, w_out = op.x, op.weights, op.ids, op.w_in, op.w_up, op.w_out
    shapes = (
        f"x {tuple(x.shape)}, weights {tuple(weights.shape)}, ids {tuple(ids.shape)}, w_in {tuple(w_in.shape)}, "
        f"w_up {None if w_up is None else tuple(w_up.shape)}, w_out {tuple(w_out.shape)}"
    )
    if x.dim() != 2 or weights.dim() != 2 or ids.shape != weights.shape or weights.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts takes x [T, H], weights [T, k], ids [T, k]: got {shapes}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or not weights.dtype.is_floating_point:
        raise ValueError(
            f"moe_experts: ids are expert ids (int64), weights floats: got {ids.dtype}, {weights.dtype}"
        )
    if w_in.dim() != 3 or w_out.dim() != 3:
        raise ValueError(
            f"moe_experts: w_in and w_out are [E, ., .] stacks of the experts' weights: got {shapes}"
        )
    experts = w_in.shape[0]
    if not 0 <= op.first_expert <= op.num_experts - experts:
        raise ValueError(
            f"moe_experts: experts {op.first_expert}..{op.first_expert + experts - 1} (w_in holds {experts}) are not "
            f"among the layer's {op.num_experts}"
        )
    hidden = x.shape[1]
    f_dim, h_in = (w_in.shape[1], w_in.shape[2]) if op.transposed else (w_in.shape[2], w_in.shape[1])
    h_out, i_dim = (w_out.shape[1], w_out.shape[2]) if op.transposed else (w_out.shape[2], w_out.shape[1])
    packed = op.gated and w_up is None
    want_f = 2 * i_dim if packed else i_dim
    layout = "[E, F, H] and [E, H, I]" if op.transposed else "[E, H, F] and [E, I, H]"
    if h_in != hidden or h_out != hidden or f_dim != want_f or w_out.shape[0] != experts:
        raise ValueError(
            f"moe_experts (transposed={op.transposed}: w_in, w_out are {layout}; F = {'2I' if packed else 'I'}): "
            f"got {shapes}"
        )
    if w_up is not None and (not op.gated or w_up.shape != w_in.shape):
        raise ValueError(
            f"moe_experts: w_up goes with gated=True and has w_in's shape: got gated={op.gated}, {shapes}"
        )


def autocast_operands(
    x: Tensor, w_in: Tensor, w_up: Tensor | None, w_out: Tensor
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """The tokens and the experts' weights in the dtype autocast runs a linear in, where autocast is
    on for their device; as they are elsewhere. The grouped matmuls are custom ops, which autocast
    does not reach: on fp32 masters they would run in fp32. Cast first, as ``F.linear`` under
    autocast casts its operands: the experts run in the half type (the output too, as a linear's),
    and the casts' backward hands fp32 gradients to the masters."""
    dev = x.device.type
    if dev == "meta" or not torch.is_autocast_enabled(dev):  # meta has no autocast
        return x, w_in, w_up, w_out
    dtype = torch.get_autocast_dtype(dev)
    return x.to(dtype), w_in.to(dtype), None if w_up is None else w_up.to(dtype), w_out.to(dtype)


def moe_experts_impl(*args, **kwargs) -> Tensor:
    """``moe_experts`` as its pieces (the op's composite implementation); the arguments are
    ``MoeOperands``'."""
    op = MoeOperands(*args, **kwargs)
    Act.of(op.act)
    check(op)
    x, w_in, w_up, w_out = autocast_operands(op.x, op.w_in, op.w_up, op.w_out)
    routing = route(op.ids, op.num_experts, op.first_expert, w_in.shape[0])
    rows = x[torch.div(routing.order, op.ids.shape[1], rounding_mode="floor")]
    out_rows = experts_mlp(rows, routing.counts, w_in, w_up, w_out, op.act, op.gated, op.transposed)
    return combine(out_rows, routing.order, op.weights, x.dtype)


_LIB = torch.library.Library("autopar", "FRAGMENT")
_LIB.define(f"moe_experts({_schema()}) -> Tensor")
_LIB.impl("moe_experts", moe_experts_impl, "CompositeImplicitAutograd")


def moe_experts(*args, **kwargs) -> Tensor:
    """``torch.ops.autopar.moe_experts`` (module docstring)."""
    return torch.ops.autopar.moe_experts(*args, **kwargs)
