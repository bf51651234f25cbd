"""The node-deduplicated expert dispatch (``codegen/experts_nodes.py``) on gloo ranks equals one
device's ``moe_experts`` and the flat all-to-all dispatch (``codegen/experts.py:expert_parallel``).

World 4 as one axis of 4 ranks, read as 2 "nodes" of 2 consecutive ranks (and, for the fixed
cases, as 4 nodes of 1 and 1 node of 4: a node group or a rail of one rank). Each rank's output
rows and the gradients of its rows of ``x`` and ``weights`` and of its slice of the experts equal
the flat dispatch's on the same routing and the single device's, to a tolerance scaled with the
values (the sums run in another order: over nodes, then ranks, then pairs). Routings: hypothesis
draws them (the style of ``test_expert_dispatch_dist.py``: experts with no tokens, ranks with no
rows), and fixed cases send every pair to one expert, every token to one node, leave ranks with
nothing to receive or to send. The bytes each stage sends are counted at the all-to-alls and
checked against ``autopar/lowerings/experts.py:node_dispatch_bytes`` on the routing's own copy
counts. All cases run in one spawned job.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from test_expert_dispatch_dist import (
    GRADS,
    Case,
    _experts,
    _grads,
    _leaves,
    _moe,
    _operands,
    _rows,
    _tensors,
    cases,
)

import autopar.kernels.moe  # noqa: F401  (registers torch.ops.autopar.moe_experts)
from autopar.launch import run_on_ranks

pytestmark = pytest.mark.slow

WORLD = 2 * 2  # 2 nodes x 2 ranks
NODE_SIZES = (2, 1, 4)  # ranks of the axis per node: the first for every case, the others for fixed ones


def _fixed() -> list[Case]:
    base = dict(k=2, experts=8, hidden=4, inter=3, act="silu", mode="packed", transposed=True, seed=3)
    rows = (3, 3, 3, 3)
    t = sum(rows)
    return [
        Case(rows=rows, ids=tuple((0, 0) for _ in range(t)), **base),  # every pair to expert 0
        Case(rows=rows, ids=tuple((4 + p % 4, 7 - p % 2) for p in range(t)), **base),  # all to node 1
        Case(rows=(0, 5, 0, 4), ids=tuple((p % 8, (p * 3) % 8) for p in range(9)), **base),  # ranks: no rows
        Case(rows=rows, ids=tuple((p % 2, 6 + p % 2) for p in range(t)), **dict(base, k=2, mode="up")),
        Case(
            rows=(2, 1, 3, 2),
            ids=tuple((p % 8, (p + 4) % 8, (p + 1) % 8) for p in range(8)),
            **dict(base, k=3, mode="plain", transposed=False, act="gelu"),
        ),  # fmt: skip
    ]


def _drawn(count: int) -> list[Case]:
    out: list[Case] = []

    @settings(max_examples=count, derandomize=True, deadline=None, database=None)
    @given(cases(WORLD))
    def collect(case):
        out.append(case)

    collect()
    return out


def _counting():
    """Record (process group, bytes sent) of every all-to-all issued until the undo (the node
    dispatch's forward); returns the record and the undo."""
    import torch.distributed as dist

    sent: list[tuple] = []
    real = dist.all_to_all_single

    def counted(out, inp, *args, group=None, **kw):
        sent.append((group, inp.numel() * inp.element_size()))
        return real(out, inp, *args, group=group, **kw)

    dist.all_to_all_single = counted

    def undo():
        dist.all_to_all_single = real

    return sent, undo


def _parts(sent, m):
    """The record with each group named by its part of the axis (``node_groups``)."""
    from autopar.codegen.collectives import current_mesh
    from autopar.codegen.experts_nodes import NODE_GROUPS_ATTR
    from autopar.reshard import AxisGroup

    rail, node = current_mesh().__dict__[NODE_GROUPS_ATTR][0, m]
    return [(AxisGroup.RAIL if g is rail else AxisGroup.NODE if g is node else None, b) for g, b in sent]


def _run(rank: int, case: Case, m: int, count: bool):
    from autopar.codegen.experts import expert_parallel
    from autopar.codegen.experts_nodes import expert_parallel_nodes

    tensors = _tensors(case)
    rows, experts = _rows(case, rank), _experts(case, rank, WORLD)
    mine = {n: (t[rows] if n in ("x", "weights", "ids", "grad") else t) for n, t in tensors.items()}
    mine = {n: (t[experts] if n.startswith("w_") and t is not None else t) for n, t in mine.items()}
    out = {}
    for name, fn, extra in (("flat", expert_parallel, (0,)), ("nodes", expert_parallel_nodes, (0, m))):
        leaves = _leaves(mine)
        sent, undo = _counting() if count and name == "nodes" else (None, lambda: None)
        try:
            y = _moe(leaves, case, fn, *extra)
        finally:
            undo()
        y.backward(mine["grad"])
        out[name] = (y.detach(), _grads(leaves), _parts(sent, m) if sent is not None else None)
    return out


def _rank(rank: int, world: int, jobs: list[tuple[Case, int]]):
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.codegen.collectives import bound_mesh

    with bound_mesh(init_device_mesh("cpu", (world,))):
        return [_run(rank, case, m, count=True) for case, m in jobs]


_JOBS: list = []


def _results():
    if not _JOBS:
        jobs = [(c, 2) for c in _fixed() + _drawn(10)] + [
            (c, m) for c in _fixed()[:3] for m in NODE_SIZES[1:]
        ]
        _JOBS.append((jobs, run_on_ranks(_rank, WORLD, jobs, timeout_s=240)))
    return _JOBS[0]


def _reference(case: Case):
    tensors = _tensors(case)
    leaves = _leaves(tensors)
    out = torch.ops.autopar.moe_experts(*_operands(leaves, case))
    out.backward(tensors["grad"])
    return out.detach(), _grads(leaves)


def _near(got, want, scale, what):
    # float64; the sums reorder: a few ulps of the largest term each value sums, never more
    tol = 1e-12 * max(1.0, float(scale))
    torch.testing.assert_close(got, want, rtol=0, atol=tol, msg=lambda msg: f"{what}: {msg}")


def test_node_dispatch_equals_flat_and_one_device():
    jobs, per_rank = _results()
    for j, (case, m) in enumerate(jobs):
        want_out, want_grads = _reference(case)
        for rank in range(WORLD):
            rows, experts = _rows(case, rank), _experts(case, rank, WORLD)
            what = f"rank {rank}, {m} ranks per node, {case}"
            out, grads, _ = per_rank[rank][j]["nodes"]
            flat_out, flat_grads, _ = per_rank[rank][j]["flat"]
            scale = want_out.abs().max() if want_out.numel() else 1.0
            _near(out, want_out[rows], scale, f"output vs one device, {what}")
            _near(out, flat_out, scale, f"output vs flat, {what}")
            assert set(grads) == set(flat_grads) == {n for n in GRADS if _tensors(case)[n] is not None}
            for name, g in grads.items():
                want = want_grads[name][rows] if name in ("x", "weights") else want_grads[name][experts]
                gscale = want_grads[name].abs().max() if want_grads[name].numel() else 1.0
                _near(g, want, gscale, f"grad {name} vs one device, {what}")
                _near(g, flat_grads[name], gscale, f"grad {name} vs flat, {what}")


def _copies(case: Case, m: int, rank: int) -> tuple[int, int, int, int]:
    """The rows ``rank`` sends over its rail (one per its tokens' destination nodes) and inside its
    node (one per destination rank there, of each copy its rail brought), and the rows it receives
    over each (which it sends back)."""
    ids = _tensors(case)["ids"]
    per = case.experts // WORLD
    node, local = divmod(rank, m)

    def node_of(e):
        return e // (per * m)

    rail = sum(len({node_of(e) for e in t}) for t in ids[_rows(case, rank)].tolist())
    arrived = [
        t for src in range(local, WORLD, m) for t in ids[_rows(case, src)].tolist() if node in map(node_of, t)
    ]
    inside = sum(len({e // per for e in t if node_of(e) == node}) for t in arrived)
    # inside the node, from each rank of it, the copies its rail brought that have a pair here
    got = sum(
        rank in {e // per for e in t}
        for peer in range(node * m, node * m + m)
        for src in range(peer % m, WORLD, m)
        for t in ids[_rows(case, src)].tolist()
        if node in map(node_of, t)
    )
    return rail, inside, len(arrived), got


def test_node_dispatch_sends_what_its_lowering_prices():
    """Per stage, the bytes each rank's forward all-to-alls send (counts, rows, weights, ids,
    partials back) on each routing equal ``node_dispatch_calls`` at the routing's own copies: one
    row per (token, destination node) over the rail, one per (copy, destination rank) inside."""
    from autopar.lowerings import Phase
    from autopar.lowerings.experts import node_dispatch_calls

    jobs, per_rank = _results()
    for j, (case, m) in enumerate(jobs):
        for rank in range(WORLD):
            rail, inside, *received = _copies(case, m, rank)
            calls = node_dispatch_calls(0, WORLD // m, m, rail, inside, case.k, case.hidden * 8, 8, received)
            want = [(c.group, c.nbytes) for c in calls if c.phase is Phase.FORWARD]
            got = per_rank[rank][j]["nodes"][2]
            assert got == want, (rank, m, case)
