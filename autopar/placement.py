"""Placements (DTensor's classes) and their compact text form used in plans and reports.

A *spec* is one placement per mesh axis, e.g. ``(Shard(0), Replicate())`` on a 2D mesh.
Text form: ``R`` (Replicate), ``S(d)`` (Shard on tensor dim d), ``P`` (Partial sum).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

Spec = tuple[Placement, ...]

R = Replicate()
P = Partial()

_SHARD_RE = re.compile(r"^S\((-?\d+)\)$")


# ``isinstance`` against DTensor's placement classes goes through a metaclass hook that is slow on a
# miss (with it alone, a third of planning time went there); the exact-type test decides the common cases.
def is_shard(p: object) -> bool:
    t = type(p)
    return t is Shard or (t is not Replicate and t is not Partial and isinstance(p, Shard))


def is_replicate(p: object) -> bool:
    t = type(p)
    return t is Replicate or (t is not Shard and t is not Partial and isinstance(p, Replicate))


def is_partial(p: object) -> bool:
    t = type(p)
    return t is Partial or (t is not Shard and t is not Replicate and isinstance(p, Partial))


def placement_to_str(p: Placement) -> str:
    if is_replicate(p):
        return "R"
    if is_shard(p):
        return f"S({p.dim})"
    if is_partial(p):
        if p.reduce_op != "sum":
            raise ValueError(f"only Partial('sum') is used by autopar, got Partial({p.reduce_op!r})")
        return "P"
    raise ValueError(f"unsupported placement {p!r}; autopar uses Replicate, Shard(dim) and Partial()")


def placement_from_str(s: str) -> Placement:
    s = s.strip()
    if s == "R":
        return R
    if s == "P":
        return P
    m = _SHARD_RE.match(s)
    if m:
        return Shard(int(m.group(1)))
    raise ValueError(f"bad placement {s!r}: expected 'R', 'P' or 'S(<dim>)'")


def spec_to_str(spec: Sequence[Placement]) -> str:
    return ",".join(placement_to_str(p) for p in spec)


def spec_from_str(s: str) -> Spec:
    return tuple(placement_from_str(x) for x in s.split(","))


def replicated(ndim_mesh: int) -> Spec:
    return (R,) * ndim_mesh


def is_replicated(spec: Sequence[Placement]) -> bool:
    return all(is_replicate(p) for p in spec)


def shard_factor(spec: Sequence[Placement], mesh_shape: Sequence[int], dim: int) -> int:
    """How many pieces tensor dim ``dim`` is cut into under ``spec``."""
    f = 1
    for p, n in zip(spec, mesh_shape):
        if is_shard(p) and p.dim == dim:
            f *= n
    return f


def local_shape(
    shape: Sequence[int], spec: Sequence[Placement], mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    """Shape of one rank's piece. Plans only use even shardings, so every rank's piece has this shape."""
    out = list(shape)
    for p, n in zip(spec, mesh_shape):
        if is_shard(p):
            d = p.dim % len(shape)
            if out[d] % n:
                raise ValueError(f"dim {d} of size {out[d]} does not divide evenly over {n} ranks")
            out[d] //= n
    return tuple(out)


def local_shapes(
    shapes: Sequence[Sequence[int]], specs: Sequence[Sequence[Placement]], mesh_shape: Sequence[int]
) -> list[tuple[int, ...]] | None:
    """``local_shape`` of each of ``shapes`` under the spec beside it; None where one does not
    divide evenly (plans never split so)."""
    try:
        return [local_shape(sh, sp, mesh_shape) for sh, sp in zip(shapes, specs)]
    except ValueError:
        return None


def volume_factor(spec: Sequence[Placement], mesh_shape: Sequence[int]) -> int:
    """Fraction (as a divisor) of a tensor's elements one rank holds."""
    f = 1
    for p, n in zip(spec, mesh_shape):
        if is_shard(p):
            f *= n
    return f


class Outputs(enum.Enum):
    """How the parallel module returns the model's outputs.

    * ``FULL``: every output whole on every rank (Replicate), as the single-device model returns
      it: what a caller that reads the logits expects, at the price of gathering them.
    * ``LOCAL``: each rank returns its piece, in the placement the plan computes the output in;
      only pending sums (Partial) are reduced. A loss is a scalar, whole either way; the logits of
      a vocabulary-parallel head stay sharded (for a 128k-token vocabulary, 67 GB gathered on every
      rank otherwise). ``ParallelModule.output_specs`` says each output's placement.
    * ``LOSS``: the model's loss alone (its first output, a scalar), whole on every rank; the other
      outputs are returned as None and never computed: what a training step reads. The logits of a
      causal LM (4 GiB of fp32 at 8192 tokens and a 128k vocabulary) then need not exist at all:
      the output projection and the loss fuse (``autopar.fusion.Kernel.LINEAR_CROSS_ENTROPY``).
    """

    FULL = "full"
    LOCAL = "local"
    LOSS = "loss"


def output_placement(spec: Sequence[Placement], outputs: Outputs) -> Spec:
    """The placement a graph output computed in ``spec`` is returned in."""
    if outputs is not Outputs.LOCAL:
        return replicated(len(spec))
    return tuple(R if is_partial(p) else p for p in spec)


class SeqAttention(enum.Enum):
    """How attention runs where its queries are split over a mesh axis along the sequence.

    * ``GATHER``: each rank's query rows against every key: K and V are all-gathered (every rank
      then holds the whole sequence's keys and values). Placements alone say it: inputs
      ``(S(L), R, R)``.
    * ``RING``: Q, K and V all stay split on the sequence; K/V blocks travel around the ring of the
      axis's ranks and each block's partial result is merged with an online softmax (Liu et al.
      2023, "Ring Attention"), each send overlapped with the previous block's compute.
    * ``ALL_TO_ALL``: DeepSpeed-Ulysses (Jacobs et al. 2023): one all-to-all per tensor turns Q, K,
      V from sequence- to head-split, attention runs on whole sequences of a slice of the heads,
      and one all-to-all turns the output back; a single K/V head (multi-query) is all-gathered.

    ``RING`` and ``ALL_TO_ALL`` take the same placements ``(S(L), S(S), S(S))``; a strategy names
    which in ``Strategy.via``."""

    GATHER = "gather"
    RING = "ring"
    ALL_TO_ALL = "all_to_all"


class OwnRows(enum.Enum):
    """An op of a data-parallel region (``passes/data_region.py``): on this axis each rank runs the
    op unchanged on the values its own rows of the batch give, as the model would run on that
    rank's rows alone. Its placements say which dim has the rank's rows (``Shard(d)``: the local
    sizes) or that the value has no batch dim (``Replicate``); they do not say that the values are
    pieces of the whole batch's: inside the region they are not (a sort of this rank's tokens is no
    slice of the sort of all tokens). Only the region's outputs are, which the region's check
    proved. No collective runs inside; the whole region is taken or none of it."""

    LOCAL = "own_rows"


class ExpertDispatch(enum.Enum):
    """How a mixture-of-experts op (``autopar::moe_experts``) runs where its experts are split over
    a mesh axis and its tokens too (expert parallelism): ``ALL_TO_ALL`` sends each (token, expert)
    pair to the rank that holds its expert and the results back, as Megatron-Core's and
    torchtitan's dropless all-to-all dispatchers do (``codegen/experts.py``). Placements alone do
    not say it: the op on local pieces would look up experts this rank does not hold.
    ``NODE_ALL_TO_ALL``, on an axis whose group spans whole nodes: each token once to each node
    that holds any of its experts (a rail-aligned all-to-all), then once to each rank there that
    holds any (an all-to-all inside the node), the partial sums back the same way (DeepEP's
    dispatch and combine; ``codegen/experts_nodes.py``)."""

    ALL_TO_ALL = "expert_all_to_all"
    NODE_ALL_TO_ALL = "expert_node_all_to_all"


class Matmul2D(enum.Enum):
    """A linear on a ``q x q`` grid of two mesh axes ``a`` and ``b`` (Optimus, Xu et al. 2021, the
    SUMMA layout): the input ``X [.., M, K]`` split as (rows on ``a``, ``K`` on ``b``), the weight
    ``W [N, K]`` as (``K`` on ``a``, ``N`` on ``b``), the output as (rows on ``a``, ``N`` on ``b``):
    activations and weights both split over both axes. Neither axis' placements are a valid
    one-axis option alone, so a strategy marks both axes with this value
    (``autopar/lowerings/matmul_nd.py``).

    * ``GATHERED``: SUMMA's ``q`` broadcast steps run as one all-gather of ``X``'s ``K`` blocks
      over ``b`` and one of ``W``'s over ``a``, then one local matmul: the bytes each rank
      receives are SUMMA's, the gathered operands (``q`` times the local ones) live through the
      op and are kept for backward. Backward each gather's gradient is reduce-scattered (the
      transposed products of SUMMA).
    * ``SUMMA``: the ``q`` steps themselves (``codegen/summa.py``): at step ``k`` one block of
      ``X`` broadcast along each row and one of ``W`` along each column, their product added;
      each step's broadcasts travel while the previous step computes. Backward broadcasts the
      blocks again and reduces each step's partial gradients to their owners: one block of each
      operand in flight, nothing gathered kept."""

    GATHERED = "2d_gathered"
    SUMMA = "summa"


class Matmul3D(enum.Enum):
    """A linear on a ``q x q`` pair of mesh axes ``b``, ``c`` as the 3D algorithm's (Agarwal et
    al. 1995; Colossal-AI's 3D tensor parallelism, Bian et al. 2021) grid of one depth slice: the
    input ``X [.., S, K]`` split as (``S`` on ``b``, ``K`` on ``c``), the weight ``W [N, K]`` as
    (``N`` on ``b``, ``K`` on ``c``), the output as (``S`` on ``c``, ``N`` on ``b``): ``X``'s
    ``S`` blocks all-gathered over ``b``, one local product (a partial sum over ``c``),
    reduce-scattered over ``c`` onto ``S``. A third axis of the same size beside the pair that
    splits another batch-like dim of ``X`` (the batch), the weight whole on it, is the cube's
    third direction; the weights' gradients are summed over it as data parallelism's are, and
    ZeRO over that axis stores them split over all ``q^3`` ranks (``autopar/lowerings/matmul_nd.py``).

    * ``GATHERED``: the gather, one product and the reduce-scatter (Colossal-AI's ``_Linear3D``)."""

    GATHERED = "3d"


Via = SeqAttention | OwnRows | Matmul2D | Matmul3D | ExpertDispatch


def via_to_str(via: Sequence[Via | None]) -> str:
    """``"ring,-"``: per mesh axis the algorithm, ``-`` where there is none ("" when none)."""
    return ",".join(v.value if v is not None else "-" for v in via) if any(via) else ""


_VIAS: dict[str, Via] = {
    v.value: v for kind in (SeqAttention, OwnRows, Matmul2D, Matmul3D, ExpertDispatch) for v in kind
}
VIA_NAMES = tuple(_VIAS)  # every algorithm's text form


def _via(t: str) -> Via:
    try:
        return _VIAS[t]
    except KeyError:
        raise ValueError(f"{t!r} names no algorithm: one of {sorted(_VIAS)}") from None


def via_from_str(s: str) -> tuple[Via | None, ...]:
    if not s:
        return ()
    return tuple(None if t == "-" else _via(t) for t in s.split(","))


def own_rows_axes(via: Sequence[Via | None]) -> tuple[int, ...]:
    """The axes on which a strategy with ``via`` runs as an op of a data-parallel region."""
    return tuple(a for a, v in enumerate(via) if v is OwnRows.LOCAL)
