"""The lowering registry: one description of each way an op runs that does more than run the op
on local tensors.

A *lowering* rewrites one traced op into rank-local code that issues collectives inside the op
(a mean loss over split rows, ring attention, ...) or keeps bytes for backward that the traced op
does not. Each is declared once, in a module of this package, as a :class:`Lowering`: the ops and
strategy marks (``via``) it serves and a function that, for one node under one strategy on a mesh,
returns its :class:`LoweringPlan`:

* ``calls``: every collective the generated code issues inside the op, in the order it issues
  them, forward then backward, as typed :class:`LoweringCall` records (kind, mesh axis, bytes,
  phase, and the share of the op's compute it can hide behind);
* ``saved_bytes``: what the lowering keeps for backward beyond what the traced op keeps;
* ``work``: the busiest rank's share of the op's work over an even share (``>= 1``: a skewed
  expert routing), by which the cost tables scale the op's compute.

Three readers, one source:

* ``codegen/lower.py`` emits the op's code from the plan (the axes and the order of its
  collectives) and the kernels it calls issue the rest;
* the cost tables (``passes/op_price.py:lowering_collectives``) price exactly ``calls``
  (:func:`price_calls`: a call's seconds less what its overlap window hides);
* the memory rows (``passes/costs.py:build_costs``) add ``saved_bytes`` to what the node keeps.

``tests/test_lowering_registry.py`` runs the generated code of every registered lowering on a fake
process group (hypothesis over shapes and meshes of 1-3 axes) and checks that the collectives it
issues, forward and backward, equal ``calls`` one for one.

Byte convention: a call's ``nbytes`` is what the comm model prices it at
(``autopar/reshard.py:CollectiveCall``): the full tensor over the axis for a gather or
reduce-scatter, the local tensor for an all-reduce or all-to-all, the bytes one rank sends for a
point-to-point hop (``SEND_RECV``: one send to the next rank and one receive from the previous).
A call's ``group`` says which ranks of its axis's group it runs over: all of them, or a rail or a
node of an axis that spans whole nodes (``AxisGroup``: the expert dispatch once per node), priced
on the inter- or intra-node link over those ranks (``cost_model/comm.py:CommModel.time``).

Overlap: calls that share a ``window`` run while the same slice of the op's compute runs; together
they cost ``max(0, sum of their seconds - hides * compute_s)``, with ``compute_s`` the op's own
compute (forward + backward, per rank) and ``hides`` the window's share of it. A call with no
window hides behind nothing. A ``deferred`` call (a returned loss's sums) runs off the step's
path and adds nothing.

Adding a lowering: a module here declaring its :class:`Lowering` (and imported below), its
emission in ``codegen/lower.py``, its sharding rule in ``passes/rules``, and example ops for the
property test (which fails for a registered lowering it has no examples of).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.fx as fx

from autopar.reshard import AxisGroup, Collective, CollectiveCall, Phase

__all__ = [
    "AxisGroup",
    "Collective",
    "LOWERINGS",
    "Lowering",
    "LoweringCall",
    "LoweringPlan",
    "Phase",
    "describe",
    "price_calls",
    "register",
]


@dataclass(frozen=True)
class LoweringCall:
    """One collective a lowering issues inside its op: ``kind`` on mesh axis ``axis``, priced at
    ``nbytes`` (module docstring), in ``phase``; ``window``: calls that share it overlap the same
    ``hides`` share of the op's compute (None: it hides behind nothing)."""

    kind: Collective
    axis: int
    nbytes: float
    phase: Phase
    window: int | None = None
    hides: float = 0.0
    # ``nbytes`` counts operands of the op in their traced dtype, which travel in the dtype the op
    # runs in: under mixed precision the half type (``LoweringPlan.in_dtype``); False: a dtype of
    # its own (a loss's fp32 sums, accumulated gradients)
    op_dtype: bool = False
    # the part of the axis's group it runs over: a rail or a node of an axis that spans nodes
    group: AxisGroup = AxisGroup.WHOLE
    # off the step's path: a returned loss's sums, which the generated forward neither runs nor
    # waits for in the op (``codegen/module.py:defer_output_sums``: the token count all-reduced
    # from the top of the forward, overlapping it; the sum carried by backward's first gradient
    # bucket, or started at the forward's end and waited for where the caller reads it); priced
    # at no seconds (``price_calls``) and no wait for the slowest rank (``passes/price.py``)
    deferred: bool = False

    def __post_init__(self) -> None:
        if self.axis < 0 or self.nbytes < 0:
            raise ValueError(f"bad lowering call {self}: axis and bytes must be >= 0")
        if self.deferred and self.window is not None:
            raise ValueError(f"bad lowering call {self}: a deferred call hides behind no window of the op")
        if not 0.0 <= self.hides <= 1.0:
            raise ValueError(f"bad lowering call {self}: hides is a share of the op's compute, in [0, 1]")
        if self.hides and self.window is None:
            raise ValueError(f"bad lowering call {self}: a call that hides needs a window")

    def collective(self) -> CollectiveCall:
        return CollectiveCall(self.kind, self.axis, self.nbytes, self.phase, self.group)


@dataclass(frozen=True)
class LoweringPlan:
    """What one node's lowering issues (``calls``, in order) and keeps for backward (bytes per
    rank, beyond what the traced op keeps)."""

    calls: tuple[LoweringCall, ...] = ()
    saved_bytes: float = 0.0
    # the busiest rank's work over an even share of the op's (an expert dispatch's skewed routing)
    work: float = 1.0

    def in_dtype(self, ratio: float) -> LoweringPlan:
        """This plan with the calls that move the op's operands (``LoweringCall.op_dtype``) at
        ``ratio`` of their traced bytes: the itemsize the op runs in over its traced one (bf16
        autocast of an fp32 trace: 0.5)."""
        if ratio == 1.0 or not any(c.op_dtype for c in self.calls):
            return self
        calls = tuple(
            dataclasses.replace(c, nbytes=c.nbytes * ratio) if c.op_dtype else c for c in self.calls
        )
        return dataclasses.replace(self, calls=calls)

    def __post_init__(self) -> None:
        if self.saved_bytes < 0:
            raise ValueError(f"a lowering keeps {self.saved_bytes} bytes: must be >= 0")
        if self.work < 1:
            raise ValueError(
                f"a lowering's busiest rank does {self.work} of an even share of the work: must be >= 1"
            )
        hides: dict[int, float] = {}
        for c in self.calls:
            if c.window is not None and hides.setdefault(c.window, c.hides) != c.hides:
                raise ValueError(f"window {c.window}'s calls disagree on the share of compute they hide")

    def axes(self, phase: Phase = Phase.FORWARD) -> tuple[int, ...]:
        """The mesh axes of the calls of ``phase``, in order of first use."""
        return tuple(dict.fromkeys(c.axis for c in self.calls if c.phase is phase))


NONE = LoweringPlan()

# describe(node, strategy, mesh_shape) -> the plan, or None where this lowering does not apply
Describe = Callable[[fx.Node, object, Sequence[int]], "LoweringPlan | None"]


@dataclass(frozen=True)
class Lowering:
    """One way an op runs: ``name``; the ops it serves; ``describe``, its plan for one node under
    one strategy (None where it does not apply: the next lowering of the op is asked)."""

    name: str
    ops: tuple
    describe: Describe


LOWERINGS: dict[str, Lowering] = {}
_BY_OP: dict[object, list[Lowering]] = {}


def register(lowering: Lowering) -> Lowering:
    """Add ``lowering`` to the registry (its name must be new)."""
    if lowering.name in LOWERINGS:
        raise ValueError(f"lowering {lowering.name!r} is registered twice")
    LOWERINGS[lowering.name] = lowering
    for op in lowering.ops:
        _BY_OP.setdefault(op, []).append(lowering)
    return lowering


def _first(node: fx.Node, s, mesh_shape: Sequence[int]) -> tuple[Lowering | None, LoweringPlan]:
    """The first registered lowering of ``node``'s op that applies under ``s``, and its plan."""
    if node.op == "call_function":
        for lw in _BY_OP.get(node.target, ()):
            plan = lw.describe(node, s, tuple(mesh_shape))
            if plan is not None:
                return lw, plan
    return None, NONE


def describe(node: fx.Node, s, mesh_shape: Sequence[int]) -> LoweringPlan:
    """The plan of the first registered lowering of ``node``'s op that applies under strategy
    ``s`` on a mesh of ``mesh_shape``; no calls and no bytes where none does."""
    return _first(node, s, mesh_shape)[1]


def lowering_of(node: fx.Node, s, mesh_shape: Sequence[int]) -> Lowering | None:
    """The registered lowering that runs ``node`` under ``s`` (None: the op runs as traced)."""
    return _first(node, s, mesh_shape)[0]


def price_calls(
    calls: Sequence[LoweringCall], seconds: Callable[[LoweringCall], float], compute_s: float
) -> list[tuple[CollectiveCall, float]]:
    """Each call with what it adds to the step: ``seconds(call)`` (the comm model's price), less
    what its window hides of ``compute_s`` (the op's own compute, forward + backward per rank),
    a window's saving shared out in proportion to its calls' seconds; a deferred call, nothing."""
    raw = [seconds(c) for c in calls]
    totals: dict[int, float] = {}
    for c, t in zip(calls, raw):
        if c.window is not None:
            totals[c.window] = totals.get(c.window, 0.0) + t
    out = []
    for c, t in zip(calls, raw):
        if c.deferred:  # off the step's path (``LoweringCall.deferred``)
            out.append((c.collective(), 0.0))
            continue
        if c.window is None:
            out.append((c.collective(), t))
            continue
        total = totals[c.window]
        left = max(0.0, total - c.hides * compute_s)
        out.append((c.collective(), t * left / total if total > 0 else 0.0))
    return out


def _load() -> None:
    # the lowerings' modules register themselves on import
    from autopar.lowerings import attention, batch_norm, experts, local, loss, matmul_nd  # noqa: F401


_load()
