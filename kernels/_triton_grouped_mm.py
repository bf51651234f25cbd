r"""Triton kernels of ``kernels/grouped_mm.py``: the grouped matmul and its weight gradient, each one
launch over all groups.

Forward, ``out[r] = x[r] w[g]`` for the rows of group ``g``. The row tiles of every group, each
``BLOCK_M`` rows that never straddle two groups, are numbered one after another: group ``g`` has
``ceil(n_g / BLOCK_M)`` of them. Their count is data (the offsets live on the device), so the grid
takes the bound ``sum_g ceil(n_g / B) <= ceil(N / B) + G`` and a tile map computed by torch on the
device, without a host read (``tile_map``): tile ``t``'s group (``G`` for the tiles past the last,
which return at once), its first row and its group's end row. Program ``(t, j)`` computes the
``[BLOCK_M, BLOCK_N]`` block of columns ``j`` of tile ``t``: a loop over ``K`` in ``BLOCK_K`` steps
of ``tl.dot``, fp32 accumulation, masked at the group's end, ``K`` and ``M``. The output starts
as zeros, so rows past ``offs[-1]`` (no tile covers them) are zero.

Weight gradient, ``dw[g] = x_g^T dy_g``: program ``(g, b)`` owns block ``b`` of ``[K, M]`` for group
``g`` and loops over the group's rows in ``BLOCK_R`` steps (bounds read from ``offs`` in the
kernel); an empty group runs no step and stores zeros. One launch, ``G * ceil(K/BK) * ceil(M/BM)``
programs; a group with many rows makes its programs the long ones (no split over rows: that would
need atomics or a second reduction pass).

Strides are passed as they are (a transposed ``w`` view is read in place). fp32 inputs use TF32 in
``tl.dot`` only where torch's own CUDA matmuls would (``torch.backends.cuda.matmul.allow_tf32``),
so the kernel agrees with the loop it replaces; fp16/bf16 multiply in their type, accumulate fp32
(upcast to fp32 first under the interpreter only: ``_upcast``).

Imported only when a Triton path runs (``kernels/dispatch.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autopar.kernels.dispatch import interpreting

# one configuration (no autotuning: the interpreter would run every candidate); 64 x 64 output
# tiles with 32-wide K steps fit fp32 operands in shared memory on sm80 at 3 stages
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
BLOCK_R = 32  # rows per step of the weight gradient's reduction
NUM_WARPS, NUM_STAGES = 4, 3


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and not interpreting():
        return "tf32"
    return "ieee"


def _upcast(dtype: torch.dtype) -> bool:
    """Whether the tiles go to fp32 before ``tl.dot``: only under the interpreter for half types
    (numpy has no bf16, and its ``tl.dot`` of bf16 tiles returns garbage); on a GPU they multiply
    in their own type (tensor cores) and accumulate in fp32, as ``torch.mm`` does."""
    return interpreting() and dtype in (torch.float16, torch.bfloat16)


def tile_map(offs: torch.Tensor, rows: int, block: int) -> tuple[torch.Tensor, int]:
    """``([3, T] int32, T)``: for each row tile ``t < T`` its group (``G`` past the last tile), first
    row and group end row; ``T = ceil(rows / block) + G`` bounds the tiles of any offsets."""
    groups = offs.shape[0]
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + block - 1) // block  # per group
    tile_ends = tiles.cumsum(0)
    bound = triton.cdiv(rows, block) + groups
    t = torch.arange(bound, device=offs.device)
    group = torch.searchsorted(tile_ends, t, right=True)  # G for tiles past the last
    g = group.clamp(max=groups - 1)
    first = starts[g] + (t - (tile_ends[g] - tiles[g])) * block
    return torch.stack([group, first, ends[g]]).to(torch.int32).contiguous(), bound


@triton.jit
def _gmm_fwd(
    X, W, OUT, MAP, T, G, K, M,
    sxn, sxk, swg, swk, swm, son, som,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    j = tl.program_id(1)
    g = tl.load(MAP + t)
    if g < G:
        first = tl.load(MAP + T + t)
        end = tl.load(MAP + 2 * T + t)
        rows = first + tl.arange(0, BLOCK_M)
        cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < end
        col_ok = cols < M
        rows64 = rows.to(tl.int64)
        cols64 = cols.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_base = W + g.to(tl.int64) * swg
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            ks64 = ks.to(tl.int64)
            a = tl.load(
                X + rows64[:, None] * sxn + ks64[None, :] * sxk,
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                w_base + ks64[:, None] * swk + cols64[None, :] * swm,
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        out = OUT + rows64[:, None] * son + cols64[None, :] * som
        tl.store(out, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gmm_wgrad(
    X, DY, OFFS, DW, K, M,
    sxn, sxk, sdn, sdm, swg, swk, swm,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    b = tl.program_id(1)
    n_cols = tl.cdiv(M, BLOCK_N)
    ks = (b // n_cols) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = (b % n_cols) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = ks < K
    col_ok = cols < M
    ks64 = ks.to(tl.int64)
    cols64 = cols.to(tl.int64)
    end = tl.load(OFFS + g)
    start = tl.load(OFFS + g - 1, mask=g > 0, other=0)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < end
        rows64 = rows.to(tl.int64)
        xt = tl.load(
            X + ks64[:, None] * sxk + rows64[None, :] * sxn, mask=k_ok[:, None] & row_ok[None, :], other=0.0
        )
        dy = tl.load(
            DY + rows64[:, None] * sdn + cols64[None, :] * sdm,
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            xt, dy = xt.to(tl.float32), dy.to(tl.float32)
        acc = tl.dot(xt, dy, acc, input_precision=PRECISION)
    out = DW + g.to(tl.int64) * swg + ks64[:, None] * swk + cols64[None, :] * swm
    tl.store(out, acc.to(DW.dtype.element_ty), mask=k_ok[:, None] & col_ok[None, :])


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out [N, M]`` of ``x [N, K]`` (any strides), ``w [G, K, M]`` (any strides), int32 ``offs``."""
    n, k = x.shape
    groups, _, m = w.shape
    out = torch.zeros((n, m), dtype=x.dtype, device=x.device)
    if n == 0 or m == 0 or groups == 0:
        return out
    tmap, tiles = tile_map(offs, n, BLOCK_M)
    grid = (tiles, triton.cdiv(m, BLOCK_N))
    _gmm_fwd[grid](
        x, w, out, tmap, tiles, groups, k, m,
        *x.stride(), *w.stride(), *out.stride(),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=_precision(x.dtype), UPCAST=_upcast(x.dtype),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out


def grouped_mm_weight_grad(
    x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, groups: int
) -> torch.Tensor:
    """``dw [groups, K, M]``: ``dw[g] = x_g^T dy_g`` for the first ``len(offs)`` groups, zeros after."""
    k, m = x.shape[1], dy.shape[1]
    dw = torch.zeros((groups, k, m), dtype=x.dtype, device=x.device)
    used = min(groups, offs.shape[0])
    if used == 0 or k == 0 or m == 0:
        return dw
    grid = (used, triton.cdiv(k, BLOCK_K) * triton.cdiv(m, BLOCK_N))
    _gmm_wgrad[grid](
        x, dy, offs, dw, k, m,
        *x.stride(), *dy.stride(), *dw.stride(),
        BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, PRECISION=_precision(x.dtype), UPCAST=_upcast(x.dtype),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return dw
