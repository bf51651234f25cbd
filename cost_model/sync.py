"""Waiting for the slowest rank: what a collective costs beyond its calibrated time.

Ranks run the same work, but not in the same time: each op's time varies a little (the OS, the
other ranks sharing the host, caches), so ranks drift apart between two synchronizing
collectives and, at the next one, every rank waits for the last to arrive. Modeled as a random
walk: after ``d`` seconds of compute since the previous collective, the expected wait is
``c * sqrt(d)``. The calibrated collective times (``autopar/tools/calibrate.py``) were measured as
what each adds to a loop of steps of ``REFERENCE_GAP_S`` of compute, so they already hold
``c * sqrt(REFERENCE_GAP_S)``; a step
pays, per synchronizing point ``i`` (a node whose inputs need collectives, in forward; a lowering
that runs one inside its op, as a split mean cross-entropy all-reduces its loss; the graph's
outputs gathered for the caller when forward ends; a node whose input gradients need collectives,
in backward; the gradient buckets' all-reduces waited for when backward ends: ``sync_points``)

    wait_i = c * max(0, sqrt(d_i) - sqrt(REFERENCE_GAP_S))                                 [s]

with ``d_i`` [s] the compute since the previous synchronizing point. Steps run back to back, so
the compute after the last one (the rest of the backward, the optimizer) joins the first gap of
the next step. A node's compute is split into forward and backward as ``FORWARD_SHARE`` and the
rest (``1 : BACKWARD_FACTOR``: a matmul's backward is two matmuls of its forward's size). An
overlapped gradient all-reduce (``codegen/grad_sync.py``) does not synchronize where it is issued,
but backward ends waiting for every bucket, which is one point: what the all-reduces cost beyond
the compute they hide behind is ``cost_model/overlap.py``'s, the ranks' drift until then is this.
Plans without a synchronizing collective wait for nothing.

Where CPU ranks share cores (``ClusterSpec.compute_slowdown > 1``) the same form holds for a
different reason. The ranks that finish their compute first wait while the others compute on
the cores they lent, which costs no time beyond the compute's own (priced shared); but the ranks
that leave a collective first compute on cores that the others still need to finish it, and the
longer they compute, the longer those wait, while a collective's own time after a barrier does
not grow (the development machine's loops: ``benchmarks/README.md``, "Readings of the
development VM").

``c_i`` [s^0.5] is ``DeviceSpec.sync_wait_for(kind)`` of the collective at point ``i`` (the largest
where several kinds run there), the device's ``HostContention`` figure: a term of CPU ranks that
share a host's cores only, 0 for a device without a contention model (every GPU preset), which
then waits for nothing here. ``autopar calibrate`` (``measure_sync_wait``) runs, on every rank,
loops of a fixed amount of compute of about each gap of ``SYNC_GAPS_S``, with and without a
collective of each kind of ``SYNC_KINDS`` after each (as ``codegen/collectives.py`` runs it), and
fits the line ``cost = a + c * sqrt(d)`` (Theil-Sen: the median slope between two points, robust
to a stalled loop) to what the collective adds to the loop's wall time (per iteration) against
the loop's compute ``d``. Loops, not the collective's own time: that
also counts a rank's wait for ranks that compute on its lent core, which the compute's price holds
already. Per kind, because where ranks share cores the wait grows with a collective's sequential
steps: a ring all-gather on ``n`` ranks runs ``n - 1`` of them, a ring all-reduce ``2 (n - 1)``
(the figures per kind, and the accuracy runs that chose a ``c`` per kind over one for all:
``benchmarks/README.md``).

The ILP prices collectives at their calibrated time; the wait depends on where the plan's
collectives fall, so it is added to the chosen plan's predicted step (``passes/price.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from autopar.cost_model.compute import BACKWARD_FACTOR

REFERENCE_GAP_S = 5e-4  # compute before each collective when calibrate times it
SYNC_GAPS_S = (2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3)  # the gaps calibrate fits the wait over
SYNC_KINDS = ("all_reduce", "all_gather", "reduce_scatter")  # the collectives it fits a wait for
FORWARD_SHARE = 1.0 / (1.0 + BACKWARD_FACTOR)  # as passes/grad_sync.py splits a node's compute


def wait_for_gap(gap_s: float, c: float) -> float:
    """``wait_i`` of the module docstring [s]."""
    return c * max(0.0, math.sqrt(max(gap_s, 0.0)) - math.sqrt(REFERENCE_GAP_S))


class SyncNode(NamedTuple):
    """One graph node as the wait sees it: its compute [s] (forward + backward, split as
    ``FORWARD_SHARE``) and the ``c`` [s^0.5] of the synchronizing collectives around it, ``None``
    where none runs: ``inputs``, the reshards of its inputs, before its forward; ``inside``, those
    its lowering runs after its own forward compute (a split mean cross-entropy's all-reduce of
    the loss); ``backward``, its input gradients' reshards, after its backward."""

    compute_s: float
    inputs: float | None = None
    inside: float | None = None
    backward: float | None = None


def sync_points(
    nodes: Sequence[SyncNode], outputs: float | None = None, buckets: float | None = None
) -> list[tuple[float, float]]:
    """``(d_i, c_i)`` of each synchronizing point of a step: the compute gap [s] before it and its
    ``c`` [s^0.5], from the step's nodes in graph order, and two points of the step itself (their
    ``c``, ``None`` where they do not run): ``outputs``, the collectives that bring the graph's
    outputs to the caller, when forward ends; ``buckets``, the wait for the gradient buckets'
    all-reduces when backward ends (``codegen/grad_sync.py``: each completes once every rank has
    issued it; what the all-reduces themselves cost beyond the compute they hide behind is
    ``cost_model/overlap.py``'s). A parameter's optimizer step, priced as its placeholder's
    compute, falls in the backward walk's last gap, before ``buckets`` instead of after it: the
    gaps on the cycle are the same but for the optimizer's share moved between two of them.
    Empty when nothing syncs."""
    points: list[tuple[float, float]] = []
    acc = 0.0

    def point(c: float | None) -> None:
        nonlocal acc
        if c is not None:
            points.append((acc, c))
            acc = 0.0

    for n in nodes:  # forward
        point(n.inputs)
        acc += n.compute_s * FORWARD_SHARE
        point(n.inside)
    point(outputs)
    for n in reversed(nodes):  # backward
        acc += n.compute_s * (1.0 - FORWARD_SHARE)
        point(n.backward)
    point(buckets)
    if points:  # the step's tail runs before the next step's first collective
        first_gap, first_c = points[0]
        points[0] = (first_gap + acc, first_c)
    return points


def sync_wait_s(
    nodes: Sequence[SyncNode], outputs: float | None = None, buckets: float | None = None
) -> float:
    """Expected seconds a step waits at its synchronizing collectives (module docstring)."""
    return sum(wait_for_gap(gap, c) for gap, c in sync_points(nodes, outputs, buckets))
