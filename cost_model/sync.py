"""Waiting for the slowest rank: what a collective costs beyond its calibrated time.

Ranks run the same work, but not in the same time: each op's time varies a little (the OS, the
other ranks sharing the host, caches), so ranks drift apart between two synchronizing
collectives and, at the next one, every rank waits for the last to arrive. Modeled as a random
walk: after ``d`` seconds of compute since the previous collective, the expected wait is
``c * sqrt(d)``. The calibrated collective times (``cost_model/calibrate.py``) were measured
after ``REFERENCE_GAP_S`` of compute, so they already hold ``c * sqrt(REFERENCE_GAP_S)``; a step
pays, per synchronizing point ``i`` (a node whose inputs need collectives, in forward; a node
whose input gradients need them, in backward)

    wait_i = c * max(0, sqrt(d_i) - sqrt(REFERENCE_GAP_S))                                 [s]

with ``d_i`` [s] the compute since the previous synchronizing point. Steps run back to back, so
the compute after the last one (the rest of the backward, the optimizer) joins the first gap of
the next step. A node's compute is split into forward and backward as ``FORWARD_SHARE`` and the
rest (``1 : BACKWARD_FACTOR``: a matmul's backward is two matmuls of its forward's size). Overlapped gradient
all-reduces (``codegen/grad_sync.py``) are not synchronizing points here: their wait is what
``cost_model/overlap.py`` prices. Plans without a synchronizing collective wait for nothing.

Where CPU ranks share cores (``ClusterSpec.compute_slowdown > 1``) the same form holds for a
different reason. The ranks that finish their compute first wait while the others compute on
the cores they lent, which costs no time beyond the compute's own (priced shared); but the ranks
that leave a collective first compute on cores that the others still need to finish it, and the
longer they compute, the longer those wait (measured on this project's VM, 4 ranks on 2 cores,
steps of steady state: a 128 KiB all-reduce added 5.9 ms to a loop with 1.1 ms of compute per
collective, 8.5 ms with 4.4 ms and 10.2 ms with 8.5 ms; a collective's own time after a barrier
stays at its calibrated ~6 ms).

``c`` [s^0.5] is ``DeviceSpec.sync_wait``: ``autopar calibrate`` (``measure_sync_wait``) runs, on
every rank, loops of a fixed amount of compute of about each gap of ``SYNC_GAPS_S``, with and
without a small all-gather after each, and fits ``cost = a + c * sqrt(d)`` by least squares to
what the all-gather adds to the loop's wall time (per iteration) against the loop's compute
``d``. Loops, not the collective's own time: that also counts a rank's wait for ranks that
compute on its lent core, which the compute's price holds already. On this project's 2-core VM
``c`` was 0.01-0.02 with 2 ranks and 0.005-0.04 with 4, from calibration to calibration; 0 for
the GPU presets, where it is not measured.

The ILP prices collectives at their calibrated time; the wait depends on where the plan's
collectives fall, so it is added to the chosen plan's predicted step (``autopar.api``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autopar.cost_model.compute import BACKWARD_FACTOR

REFERENCE_GAP_S = 5e-4  # compute before each collective when calibrate times it
SYNC_GAPS_S = (2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3)  # the gaps calibrate fits the wait over
FORWARD_SHARE = 1.0 / (1.0 + BACKWARD_FACTOR)  # as passes/grad_sync.py splits a node's compute


def wait_for_gap(gap_s: float, c: float) -> float:
    """``wait_i`` of the module docstring [s]."""
    return c * max(0.0, math.sqrt(max(gap_s, 0.0)) - math.sqrt(REFERENCE_GAP_S))


def sync_gaps(nodes: Sequence[tuple[float, bool, bool]]) -> list[float]:
    """The compute gaps [s] before each synchronizing point of a step, from its nodes in graph
    order as ``(compute_s, syncs_in_forward, syncs_in_backward)``; empty when nothing syncs."""
    if not any(f or b for _, f, b in nodes):
        return []
    gaps: list[float] = []
    acc = 0.0
    for t, fwd_sync, _ in nodes:  # forward: a node's collectives run before it
        if fwd_sync:
            gaps.append(acc)
            acc = 0.0
        acc += t * FORWARD_SHARE
    for t, _, bwd_sync in reversed(nodes):  # backward: its input gradients' collectives after it
        acc += t * (1.0 - FORWARD_SHARE)
        if bwd_sync:
            gaps.append(acc)
            acc = 0.0
    gaps[0] += acc  # the step's tail runs before the next step's first collective
    return gaps


def sync_wait_s(nodes: Sequence[tuple[float, bool, bool]], c: float) -> float:
    """Expected seconds a step waits at its synchronizing collectives (module docstring)."""
    if c <= 0:
        return 0.0
    return sum(wait_for_gap(g, c) for g in sync_gaps(nodes))
