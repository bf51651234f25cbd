"""Expert parallelism on gloo ranks equals the single-device ``moe_experts``.

``expert_parallel`` (tokens split over the axis in contiguous blocks, experts in contiguous
blocks, all-to-all dispatch and combine): each rank's output rows and the gradients of its rows of
``x`` and ``weights`` and of its experts' weights equal the matching rows and slices of one
device's ``moe_experts`` and its gradients, over any routing: hypothesis draws them in the parent
(with sizes per rank, zero included), the fixed cases add every token to one expert, experts with
no tokens, ranks that receive none and a rank with no rows of its own. ``capacity_factor`` drops
what ``codegen/experts.py`` documents: per expert, the pairs past ``ceil(c T k / E)`` in global
token order, i.e. the reference's weights of those pairs set to 0. ``local_experts`` summed over
the ranks equals the whole layer. In the world-4 job the world-2 cases also run on each axis of a
2 x 2 mesh (the axis named, not the world, carries the experts). All cases of one world size run
in one spawned job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.kernels.moe import MoeOperands  # registers torch.ops.autopar.moe_experts too
from autopar.launch import run_on_ranks

pytestmark = pytest.mark.slow

MODES = ("packed", "up", "plain")  # gated with w_in [gate; up], gated with w_up, not gated


@dataclass(frozen=True)
class Case:
    rows: tuple[int, ...]  # tokens of each rank
    k: int
    experts: int
    hidden: int
    inter: int
    act: str
    mode: str
    transposed: bool
    ids: tuple[tuple[int, ...], ...]  # [T, k]
    seed: int
    capacity_factor: float | None = None


def _tensors(case: Case) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(case.seed)
    e, h, i, t = case.experts, case.hidden, case.inter, sum(case.rows)
    f = 2 * i if case.mode == "packed" else i
    shape_in, shape_out = ((e, f, h), (e, h, i)) if case.transposed else ((e, h, f), (e, i, h))

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "x": rand(t, h),
        "weights": torch.rand(t, case.k, generator=g, dtype=torch.float64),
        "ids": torch.tensor(case.ids, dtype=torch.int64).reshape(t, case.k),
        "w_in": rand(*shape_in) / math.sqrt(h),
        "w_up": rand(*shape_in) / math.sqrt(h) if case.mode == "up" else None,
        "w_out": rand(*shape_out) / math.sqrt(i),
        "grad": rand(t, h),
    }


GRADS = ("x", "weights", "w_in", "w_up", "w_out")


def _operands(tensors, case: Case) -> MoeOperands:
    return MoeOperands(
        tensors["x"], tensors["weights"], tensors["ids"], tensors["w_in"], tensors["w_up"], tensors["w_out"],
        case.act, case.mode != "plain", case.transposed, case.experts,
    )  # fmt: skip


def _moe(tensors, case: Case, fn, *extra):
    """An expert-parallel form ``fn`` (``codegen/experts*.py``) on the case's tensors."""
    return fn(_operands(tensors, case), *extra)


def _leaves(tensors) -> dict:
    return {
        name: (t.detach().clone().requires_grad_(name in GRADS) if t is not None else None)
        for name, t in tensors.items()
    }


def _grads(leaves) -> dict:
    return {n: leaves[n].grad for n in GRADS if leaves[n] is not None}


def _kept(case: Case, ids: torch.Tensor) -> torch.Tensor:
    """[T, k] mask of the pairs an expert keeps under ``capacity_factor`` (all where None)."""
    if case.capacity_factor is None:
        return torch.ones(ids.shape, dtype=torch.bool)
    t, k = ids.shape
    cap = math.ceil(case.capacity_factor * t * k / case.experts)
    seen = [0] * case.experts
    keep = torch.zeros(t * k, dtype=torch.bool)
    for p, e in enumerate(ids.reshape(-1).tolist()):  # pair order t k + j: global token order
        keep[p] = seen[e] < cap
        seen[e] += 1
    return keep.view(t, k)


def _reference(case: Case):
    tensors = _tensors(case)
    leaves = _leaves(tensors)
    mask = _kept(case, tensors["ids"]).to(torch.float64)
    masked = dict(leaves, weights=leaves["weights"] * mask)
    out = torch.ops.autopar.moe_experts(*_operands(masked, case))
    out.backward(tensors["grad"])
    return out.detach(), _grads(leaves)


def _run_cases(coord: int, n: int, axis: int, cases: list[Case]) -> list:
    """Each case on coordinate ``coord`` of ``n`` along ``axis`` of the bound mesh: its rows and
    experts, ``expert_parallel``; every row and its experts, ``local_experts``."""
    from autopar.codegen.experts import expert_parallel, local_experts

    results = []
    for case in cases:
        tensors = _tensors(case)
        rows, experts = _rows(case, coord), _experts(case, coord, n)
        mine = {n: (t[rows] if n in ("x", "weights", "ids", "grad") else t) for n, t in tensors.items()}
        mine = {n: (t[experts] if n.startswith("w_") and t is not None else t) for n, t in mine.items()}
        leaves = _leaves(mine)
        out = _moe(leaves, case, expert_parallel, axis, case.capacity_factor)
        out.backward(mine["grad"])
        split = (out.detach(), _grads(leaves))
        # tokens replicated, experts split: this coordinate's summand of the whole layer
        whole = _leaves(
            {n: (t[experts] if n.startswith("w_") and t is not None else t) for n, t in tensors.items()}
        )
        part = _moe(whole, case, local_experts, axis)
        part.backward(tensors["grad"])
        results.append((split, (part.detach(), _grads(whole))))
    return results


def _rank(rank: int, world: int, cases: list[Case], grid_cases: list[Case]):
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.codegen.collectives import bound_mesh

    with bound_mesh(init_device_mesh("cpu", (world,))):
        flat = _run_cases(rank, world, 0, cases)
    grid = {}
    if grid_cases:  # world 4 as a 2 x 2 mesh: the axis given, not the world, carries the experts
        mesh = init_device_mesh("cpu", (2, 2))
        with bound_mesh(mesh):
            for axis in (0, 1):
                grid[axis] = _run_cases(mesh.get_local_rank(axis), 2, axis, grid_cases)
    return flat, grid


def _rows(case: Case, coord: int) -> slice:
    start = sum(case.rows[:coord])
    return slice(start, start + case.rows[coord])


def _experts(case: Case, coord: int, n: int) -> slice:
    per = case.experts // n
    return slice(coord * per, (coord + 1) * per)


@st.composite
def cases(draw, world: int) -> Case:
    rows = tuple(draw(st.lists(st.integers(0, 5), min_size=world, max_size=world)))
    if sum(rows) == 0:
        rows = (1,) + rows[1:]
    k = draw(st.integers(1, 3))
    experts = world * draw(st.integers(1, 3))
    t = sum(rows)
    # few distinct experts per draw: experts with no tokens, ranks that receive none
    used = draw(st.lists(st.integers(0, experts - 1), min_size=1, max_size=experts, unique=True))
    ids = tuple(tuple(draw(st.sampled_from(used)) for _ in range(k)) for _ in range(t))
    return Case(
        rows=rows, k=k, experts=experts,
        hidden=draw(st.integers(1, 6)), inter=draw(st.integers(1, 4)),
        act=draw(st.sampled_from(("silu", "gelu", "gelu_tanh", "relu"))),
        mode=draw(st.sampled_from(MODES)), transposed=draw(st.booleans()),
        ids=ids, seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def _drawn(world: int, count: int) -> list[Case]:
    out: list[Case] = []

    @settings(max_examples=count, derandomize=True, deadline=None, database=None)
    @given(cases(world))
    def collect(case):
        out.append(case)

    collect()
    return out


def _fixed(world: int) -> list[Case]:
    base = dict(k=2, experts=2 * world, hidden=4, inter=3, act="silu", mode="packed", transposed=True, seed=7)
    rows = tuple(3 for _ in range(world))
    t = sum(rows)
    last = 2 * world - 1
    skewed = tuple((last, 0) if p % 2 else (last, last - 1) for p in range(t))
    return [
        Case(
            rows=rows, ids=tuple((0, 0) for _ in range(t)), **base
        ),  # every pair to expert 0: rank 0 gets all
        Case(rows=rows, ids=skewed, **base),  # the middle ranks receive nothing
        Case(rows=(0,) + rows[1:], ids=tuple((p % 3, last) for p in range(t - 3)), **base),  # rank 0: no rows
        Case(rows=rows, ids=skewed, capacity_factor=0.5, **dict(base, mode="up", transposed=False)),
        Case(rows=rows, ids=tuple((0, 1) for _ in range(t)), capacity_factor=1.0, **base),
    ]


_RUNS: dict[int, tuple] = {}
GRID_CASES = 4  # drawn world-2 cases run on each axis of a 2 x 2 mesh, besides the fixed ones


def _world(world: int) -> tuple:
    """The cases of one world size and every rank's results: one spawned job per world, run once."""
    if world not in _RUNS:
        cases_ = _fixed(world) + _drawn(world, 12 if world == 2 else 8)
        grid_cases = _fixed(2) + _drawn(2, GRID_CASES) if world == 4 else []
        per_rank = run_on_ranks(_rank, world, cases_, grid_cases, timeout_s=240)
        _RUNS[world] = cases_, [flat for flat, _ in per_rank], grid_cases, [grid for _, grid in per_rank]
    return world, *_RUNS[world]


@pytest.fixture(scope="module", params=[2, 4])
def runs(request):
    return _world(request.param)


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


def _check_split(case: Case, coord: int, n: int, result, what: str) -> None:
    """One coordinate's ``expert_parallel`` output and gradients against the single device's rows
    and expert slices."""
    want_out, want_grads = _reference(case)
    out, grads = result
    rows, experts = _rows(case, coord), _experts(case, coord, n)
    what = f"{what}, coordinate {coord} of {n}, {case}"
    _close(out, want_out[rows], f"output, {what}")
    assert set(grads) == set(want_grads)
    for name, g in grads.items():
        want = want_grads[name][rows] if name in ("x", "weights") else want_grads[name][experts]
        _close(g, want, f"grad {name}, {what}")


def test_expert_parallel_equals_one_device(runs):
    world, cases_, per_rank, _, _ = runs
    for c, case in enumerate(cases_):
        for rank in range(world):
            _check_split(case, rank, world, per_rank[rank][c][0], f"world {world}")


def test_expert_parallel_runs_on_the_axis_it_is_given():
    world, _, _, grid_cases, grids = _world(4)
    for axis in (0, 1):
        for rank in range(world):
            coord = rank // 2 if axis == 0 else rank % 2
            for c, case in enumerate(grid_cases):
                _check_split(case, coord, 2, grids[rank][axis][c][0], f"2 x 2 mesh, axis {axis}, rank {rank}")


def test_capacity_drops_pairs_past_the_capacity_in_token_order(runs):
    # the masked reference above differs from the dropless layer: the drop is real in these cases
    _, cases_, _, _, _ = runs
    capped = [case for case in cases_ if case.capacity_factor is not None]
    assert capped
    for case in capped:
        assert not _kept(case, _tensors(case)["ids"]).all()
        dropless, _ = _reference(Case(**{**case.__dict__, "capacity_factor": None}))
        assert not torch.allclose(dropless, _reference(case)[0])


def test_local_experts_sum_over_ranks_to_the_whole_layer(runs):
    world, cases_, per_rank, _, _ = runs
    for c, case in enumerate(cases_):
        want_out, want_grads = _reference(Case(**{**case.__dict__, "capacity_factor": None}))
        parts = [per_rank[rank][c][1] for rank in range(world)]
        _close(sum(out for out, _ in parts), want_out, f"local_experts output, world {world}, {case}")
        for name in ("x", "weights"):
            _close(sum(g[name] for _, g in parts), want_grads[name], f"local_experts grad {name}, {case}")
        for rank, (_, grads) in enumerate(parts):
            for name in ("w_in", "w_up", "w_out"):
                if name in grads:
                    want = want_grads[name][_experts(case, rank, world)]
                    _close(grads[name], want, f"local_experts grad {name}, rank {rank}, {case}")
