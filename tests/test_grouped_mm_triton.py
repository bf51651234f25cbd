"""The Triton grouped matmul (``kernels/_triton_grouped_mm.py``) against a loop of ``mm``, run by
Triton's interpreter on CPU (``TRITON_INTERPRET=1`` from conftest, ``AUTOPAR_KERNELS=triton``), and
the choice of implementation (``kernels/grouped_mm.py:choose_path``) for every device kind, dtype
and backend, which needs no GPU.

Values and both gradients (``dx`` through the forward kernel on ``w^T``, ``dw`` through the weight
gradient kernel) over empty groups, uneven groups, groups longer than one row tile, rows past the
last offset, transposed weight views, fp32 and bf16; a hypothesis property over group sizes.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.kernels.dispatch import ENV, Backend
from autopar.kernels.grouped_mm import Path, choose_path, path_for

pytest.importorskip("triton")

from autopar.kernels import _triton_grouped_mm as tg  # noqa: E402

grouped_mm = torch.ops.autopar.grouped_mm


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv(ENV, "triton")


def _loop_mm(x, w, offs):
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end].double() @ w[g].double()
        start = end
    return out


def _scale(t):
    """The largest magnitude in ``t``, at least 1: what an absolute tolerance scales with."""
    return max(1.0, float(t.detach().abs().max())) if t.numel() else 1.0


def _case(sizes, tail, k, m, transposed, dtype=torch.float32):
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes) + tail, k, dtype=dtype, requires_grad=True)
    shape = (len(sizes), m, k) if transposed else (len(sizes), k, m)
    base = torch.randn(shape, dtype=dtype, requires_grad=True)
    return x, base, (base.transpose(-2, -1) if transposed else base), offs


def _check(sizes, tail, k, m, transposed, dtype=torch.float32):
    x, base, w, offs = _case(sizes, tail, k, m, transposed, dtype)
    assert path_for(x, w) is Path.TRITON and path_for(x.t(), x) is Path.TRITON
    out = grouped_mm(x, w, offs)
    assert out.dtype == dtype and out.shape == (x.shape[0], m)
    want = _loop_mm(x.detach(), w.detach(), offs)
    # fp32 accumulation over k terms: scale the tolerance with the dtype's rounding and the values
    eps = torch.finfo(dtype).eps
    tol = dict(rtol=8 * eps, atol=8 * eps * _scale(want))
    torch.testing.assert_close(out.double(), want, **tol)
    assert not out[sum(sizes) :].any()  # rows past the last offset are zeros
    grad = torch.randn(want.shape, dtype=dtype)
    dx, dbase = torch.autograd.grad(out, (x, base), grad)
    xd, based = x.detach().double().requires_grad_(), base.detach().double().requires_grad_()
    wd = based.transpose(-2, -1) if transposed else based
    ref = torch.autograd.grad(_loop_mm(xd, wd, offs), (xd, based), grad.double())
    for got, exp in zip((dx, dbase), ref):
        torch.testing.assert_close(got.double(), exp, rtol=8 * eps, atol=8 * eps * _scale(exp))
    ends = offs.tolist()
    for g, (lo, hi) in enumerate(zip([0] + ends[:-1], ends)):
        if hi == lo:  # an empty group's weight gradient is zero
            assert not dbase[g].any()


@pytest.mark.parametrize(
    "sizes, tail, k, m, transposed",
    [
        ([3, 0, 5], 2, 7, 9, True),  # an empty group, rows past the end, a transposed view
        ([70, 1, 0, 130], 3, 40, 70, False),  # groups over one 64-row tile, K over one 32-wide step
        ([0, 0], 4, 5, 3, True),  # no row in any group: all zeros
        ([1], 0, 1, 1, False),
    ],
)
def test_triton_grouped_mm_equals_the_loop(sizes, tail, k, m, transposed, triton_backend):
    _check(sizes, tail, k, m, transposed)


def test_triton_grouped_mm_bf16(triton_backend):
    _check([5, 0, 17], 3, 24, 40, True, torch.bfloat16)


@settings(max_examples=15)
@given(
    sizes=st.lists(st.integers(0, 70), min_size=1, max_size=5),
    tail=st.integers(0, 3),
    k=st.integers(1, 40),
    m=st.integers(1, 40),
    transposed=st.booleans(),
)
def test_triton_grouped_mm_property(sizes, tail, k, m, transposed):
    with mock.patch.dict(os.environ, {ENV: "triton"}):
        _check(sizes, tail, k, m, transposed)


def test_tile_map_covers_each_group_once():
    """Every row of a group is in exactly one tile, tiles never cross a group's end, and the tiles
    past the last carry the group count (they return at once)."""
    offs = torch.tensor([0, 130, 130, 131, 200], dtype=torch.int32)
    tmap, bound = tg.tile_map(offs, 205, 64)
    group, first, end = tmap.tolist()
    assert bound == 4 + 5
    covered = []
    for g, f, e in zip(group, first, end):
        if g < 5:
            assert e == offs[g] and f < e
            covered += [(g, r) for r in range(f, min(f + 64, e))]
    starts = [0, 0, 130, 130, 131]
    assert covered == [(g, r) for g in range(5) for r in range(starts[g], int(offs[g]))]
    assert group[-1] == 5


def test_weight_grad_past_the_offsets_is_zero(triton_backend):
    """``groups`` beyond ``len(offs)``: those blocks are zero, as the loop leaves them."""
    x, dy = torch.randn(6, 3), torch.randn(6, 4)
    offs = torch.tensor([2, 6], dtype=torch.int32)
    dw = torch.ops.autopar.grouped_mm_weight_grad(x, dy, offs, 3)
    torch.testing.assert_close(dw[0], x[:2].t() @ dy[:2])
    torch.testing.assert_close(dw[1], x[2:].t() @ dy[2:])
    assert not dw[2].any()


@pytest.mark.parametrize(
    "kernels, device, dtype, runs, triton, want",
    [
        # A100 (sm80): torch._grouped_mm does not run, Triton does
        (Backend.AUTO, "cuda", torch.bfloat16, False, True, Path.TRITON),
        (Backend.AUTO, "cuda", torch.float16, False, True, Path.TRITON),
        (Backend.AUTO, "cuda", torch.float32, False, True, Path.TRITON),
        # H100 bf16 with aligned strides: torch's own kernel
        (Backend.AUTO, "cuda", torch.bfloat16, True, True, Path.GROUPED_MM),
        (Backend.AUTO, "cuda", torch.bfloat16, False, False, Path.LOOP),  # no Triton installed
        (Backend.AUTO, "cuda", torch.float64, False, True, Path.LOOP),  # tl.dot has no fp64 here
        (Backend.AUTO, "cpu", torch.float32, True, False, Path.GROUPED_MM),
        (Backend.AUTO, "cpu", torch.float32, False, True, Path.LOOP),  # Triton only on CUDA
        (Backend.TORCH, "cuda", torch.bfloat16, True, True, Path.LOOP),
        (Backend.TRITON, "cuda", torch.bfloat16, True, True, Path.TRITON),
        (Backend.TRITON, "cpu", torch.float32, True, True, Path.TRITON),  # the interpreter
        (Backend.TRITON, "cpu", torch.float64, False, True, Path.LOOP),
    ],
)
def test_choose_path(kernels, device, dtype, runs, triton, want):
    assert choose_path(kernels, device, dtype, runs, triton) is want


def test_cpu_default_never_picks_triton(monkeypatch):
    monkeypatch.setenv(ENV, "auto")
    x, w = torch.randn(5, 3), torch.randn(2, 3, 7)  # unaligned: not torch._grouped_mm either
    assert path_for(x, w) is Path.LOOP
    monkeypatch.setenv(ENV, "torch")
    assert path_for(torch.randn(4, 16), torch.randn(2, 16, 16)) is Path.LOOP


@pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="compiled Triton needs CUDA: run with TRITON_INTERPRET=0 on a GPU",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_compiled_grouped_mm_matches_the_loop(dtype, monkeypatch):
    """Model-sized, unaligned (K = 1000, M = 700 rows of 2-byte types are not 16-byte multiples),
    uneven and empty groups, the weight used transposed as Hugging Face stores it."""
    monkeypatch.setenv(ENV, "triton")
    sizes = [700, 0, 1, 3000, 129]
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes) + 50, 1000, device="cuda", dtype=dtype, requires_grad=True)
    base = torch.randn(len(sizes), 700, 1000, device="cuda", dtype=dtype, requires_grad=True)
    out = grouped_mm(x, base.transpose(-2, -1), offs)
    grad = torch.randn_like(out)
    dx, dw = torch.autograd.grad(out, (x, base), grad)
    xd, bd = x.detach().double().requires_grad_(), base.detach().double().requires_grad_()
    monkeypatch.setenv(ENV, "torch")
    loop = grouped_mm(xd, bd.transpose(-2, -1), offs)
    rdx, rdw = torch.autograd.grad(loop, (xd, bd), grad.double())
    for got, exp in ((out, loop), (dx, rdx), (dw, rdw)):
        # fp32 accumulation over up to 3000 terms; TF32 / half inputs round each product's operands
        eps = torch.finfo(torch.bfloat16 if dtype == torch.float32 else dtype).eps
        torch.testing.assert_close(
            got.double(), exp.detach(), rtol=4 * eps, atol=4 * eps * _scale(exp.detach())
        )
