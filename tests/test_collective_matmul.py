"""Collective matmuls (``kernels/collective_matmul.py``) compute what the unfused collectives do.

The kernels, on gloo world 2 and 4 (the whole world and, on 4, each axis of a 2 x 2 mesh, whose
groups are not runs of consecutive ranks on axis 0): ``all_gather_linear`` against the linear of
the gathered input (column-parallel weight, the input's gradient reduce-scattered; replicated
weight, no reduction; the gathered input also read by another op), ``linear_reduce_scatter``
against the linear of the whole input reduce-scattered (row-parallel weight, a ``Partial`` bias),
along the batch, the sequence and (reduce-scatter) the features; forward and every gradient,
fp32, from one full reference computed on each rank with autograd. Then end to end: tiny Llama
and GPT-2 on a tensor-parallel axis with the sequence split around the linears (Megatron-style
sequence parallelism, made by editing the plan, ``_sequence_parallel``), ``overlap_matmuls`` on
and off: both train as one device does (loss and full state after 2 Adam steps), and the
generated code calls the fused collectives when on and none when off.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.launch import run_on_ranks

pytestmark = pytest.mark.slow

B, S, IN, OUT = 4, 6, 8, 10


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed))


def _gather_case(group, dim: int, split_weight: bool, keep: bool) -> dict[str, float]:
    import torch.distributed as dist

    from autopar.kernels.collective_matmul import all_gather_linear

    n, r = dist.get_world_size(group), dist.get_rank(group)
    out_total = OUT * n if split_weight else OUT
    x_full = _randn(B * n if dim == 0 else B, S * n if dim == 1 else S, IN, seed=1)
    w_full, b_full = _randn(out_total, IN, seed=2), _randn(out_total, seed=3)
    g_full = _randn(*x_full.shape[:-1], out_total, seed=4)
    h_full = [_randn(*x_full.shape, seed=10 + j) for j in range(n)]  # each rank's gradient of `gathered`
    # the reference, on full tensors: the linear with every rank's weight block side by side
    X = x_full.clone().requires_grad_()
    W, Bb = w_full.clone().requires_grad_(), b_full.clone().requires_grad_()
    Y = F.linear(X, W, Bb)
    loss = (Y * g_full).sum()
    if keep:
        hs = h_full if split_weight else [h_full[0]]  # whole on every rank: counted once
        loss = loss + sum((2 * X * h).sum() for h in hs)
    loss.backward()
    # this rank's run
    x = x_full.chunk(n, dim)[r].clone().requires_grad_()
    # column-parallel: this rank's block of output features (their weight rows), else all of them
    blk = (lambda t: t.chunk(n, -1)[r]) if split_weight else (lambda t: t)
    w = (w_full.chunk(n, 0)[r] if split_weight else w_full).clone().requires_grad_()
    b, g = blk(b_full).clone().requires_grad_(), blk(g_full)
    res = all_gather_linear(x, w, b, dim, group, reduce_grad=split_weight, keep_gathered=keep)
    y, gathered = res if keep else (res, None)
    loss = (y * g).sum()
    if keep:
        loss = loss + (2 * gathered * h_full[r if split_weight else 0]).sum()
    loss.backward()
    return {
        "out": (y - blk(Y.detach())).abs().max().item(),
        "grad x": (x.grad - X.grad.chunk(n, dim)[r]).abs().max().item(),
        "grad w": (w.grad - (W.grad.chunk(n, 0)[r] if split_weight else W.grad)).abs().max().item(),
        "grad b": (b.grad - blk(Bb.grad)).abs().max().item(),
        **({"gathered": (gathered - x_full).abs().max().item()} if keep else {}),
    }


def _scatter_case(group, dim: int) -> dict[str, float]:
    import torch.distributed as dist

    from autopar.kernels.collective_matmul import linear_reduce_scatter

    n, r = dist.get_world_size(group), dist.get_rank(group)
    out_total = OUT * n if dim == 2 else OUT
    x_full = _randn(B * n if dim == 0 else B, S * n if dim == 1 else S, IN * n, seed=5)
    w_full, b_full = _randn(out_total, IN * n, seed=6), _randn(out_total, seed=7)
    g_full = _randn(*x_full.shape[:-1], out_total, seed=8)
    X = x_full.clone().requires_grad_()
    W, Bb = w_full.clone().requires_grad_(), b_full.clone().requires_grad_()
    Y = F.linear(X, W, Bb)
    (Y * g_full).sum().backward()
    # row-parallel: this rank's input features and weight columns; the bias on rank 0 only (Partial)
    x = x_full.chunk(n, -1)[r].clone().requires_grad_()
    w = w_full.chunk(n, 1)[r].clone().requires_grad_()
    b = (b_full if r == 0 else torch.zeros_like(b_full)).clone().requires_grad_()
    y = linear_reduce_scatter(x, w, b, dim, group)
    (y * g_full.chunk(n, dim)[r]).sum().backward()
    return {
        "out": (y - Y.detach().chunk(n, dim)[r]).abs().max().item(),
        "grad x": (x.grad - X.grad.chunk(n, -1)[r]).abs().max().item(),
        "grad w": (w.grad - W.grad.chunk(n, 1)[r]).abs().max().item(),
        "grad b": (b.grad - Bb.grad).abs().max().item(),
    }


def _errors(group) -> list[str]:
    """The messages of the calls the kernels refuse."""
    from autopar.errors import CollectiveMatmulError
    from autopar.kernels.collective_matmul import all_gather_linear, linear_reduce_scatter

    out = []
    for call in (
        lambda: all_gather_linear(torch.ones(2, 3), torch.ones(4, 3), None, -1, group),
        lambda: linear_reduce_scatter(torch.ones(3, 3), torch.ones(4, 3), None, 0, group),
    ):
        try:
            call()
            out.append("")
        except CollectiveMatmulError as e:
            out.append(str(e))
    return out


def _kernel_rank(rank: int, world: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    groups = {"world": dist.group.WORLD}
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2))
        groups |= {"axis0": mesh.get_group(0), "axis1": mesh.get_group(1)}
    results = {}
    for name, group in groups.items():
        for dim in (0, 1):
            for split in (True, False):
                for keep in (False, True):
                    results[(name, "gather", dim, split, keep)] = _gather_case(group, dim, split, keep)
        for dim in (0, 1, 2):
            results[(name, "scatter", dim)] = _scatter_case(group, dim)
    return results, _errors(dist.group.WORLD)


_KERNELS: dict[int, list] = {}


@pytest.fixture(scope="module", params=[2, 4])
def kernel_runs(request):
    world = request.param
    if world not in _KERNELS:
        _KERNELS[world] = run_on_ranks(_kernel_rank, world, timeout_s=300)
    return world, _KERNELS[world]


def test_collective_matmuls_equal_the_unfused_collectives(kernel_runs):
    world, per_rank = kernel_runs
    for rank, (results, _) in enumerate(per_rank):
        assert len(results) == (1 if world == 2 else 3) * 11
        for case, errs in results.items():
            for what, err in errs.items():
                assert err < 1e-5, f"world {world} rank {rank} {case}: {what} off by {err}"


def test_collective_matmuls_refuse_what_they_cannot_cut(kernel_runs):
    world, per_rank = kernel_runs
    contracted, uneven = per_rank[0][1]
    assert "contracted (last) dim" in contracted
    assert "not a multiple of the group's" in uneven and "overlap_matmuls=False" in uneven
