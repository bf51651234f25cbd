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

Only where every rank has a core (or an accelerator) of its own: CPU ranks that share cores
(``ClusterSpec.compute_slowdown > 1``) take turns on them, and a rank that waits lends its core to
the rank it waits for, so drift costs no time beyond the calibrated collectives (measured: with
4 ranks on this VM's 2 cores, the square-root wait fitted there over-predicted every plan by
25-70%). ``autopar calibrate`` measures ``c`` only when the ranks have their own cores.

``c`` [s^0.5] is ``DeviceSpec.sync_wait``: ``autopar calibrate`` times a small all-gather after
a fixed amount of compute of about each gap of ``SYNC_GAPS_S`` on every rank, one gap at a time,
and fits ``t = a + c * sqrt(d)`` by least squares (on this project's 2-core VM 0.01-0.05 with 2
ranks, from run to run). 0 for the GPU presets, where it is not measured.

The ILP prices collectives at their calibrated time; the wait depends on where the plan's
collectives fall, so it is added to the chosen plan's predicted step (``autopar.api``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autopar.cost_model.compute import BACKWARD_FACTOR

REFERENCE_GAP_S = 5e-4  # compute before each collective when calibrate times it
SYNC_GAPS_S = (2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3)  # the gaps calibrate fits the wait over
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
