"""SUMMA (van de Geijn and Watts 1997; Optimus, Xu et al. 2021) on a ``q x q`` grid of mesh axes.

Rank ``(i, j)`` (``i`` its coordinate on axis ``a``, ``j`` on axis ``b``) holds ``X_ij`` (rows
block ``i``, ``K`` block ``j``) and ``W_ij`` (``K`` block ``i``, ``N`` block ``j``) and computes
``Y_ij = sum_k X_ik W_kj`` in ``q`` steps: at step ``k`` rank ``(i, k)`` broadcasts ``X_ik`` along
its row (axis ``b``) and rank ``(k, j)`` broadcasts ``W_kj`` along its column (axis ``a``); every
rank adds the product of the two blocks. Step ``k + 1``'s broadcasts are issued before step
``k``'s product runs, so they travel while it computes.

Backward, from ``dY_ij``: ``dX_ik = sum_j dY_ij W_kj`` and ``dW_kj = sum_i X_ik dY_ij`` (each
transposed as the op's layout needs). At step ``k`` the blocks ``X_ik`` and ``W_kj`` are broadcast
again (nothing gathered is kept: the memory stays at one block of each in flight), each rank
computes its two partial products, and they are reduced along the row to ``(i, k)`` and along the
column to ``(k, j)``: every rank receives exactly its own ``dX_ij`` (at step ``j``) and ``dW_ij``
(at step ``i``). A step's reductions travel while the next step computes.

The algorithm is written once against a :class:`Transport` (broadcast and reduce along a row or a
column): :class:`DistGrid` runs it on the mesh's process groups, and
``autopar/tools/simulate.py`` on simulated ranks in threads. Its collectives are the ones
``autopar/lowerings/matmul_nd.py`` describes and prices, call for call.
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from autopar.codegen.collectives import axis_group, current_mesh


class Side(enum.Enum):
    """Along which grid direction a collective runs: a row (mesh axis ``b``, the ranks that share
    ``i``) or a column (axis ``a``)."""

    ROW = "row"
    COL = "col"


class Pending(Protocol):
    def wait(self) -> torch.Tensor | None: ...


class Transport(Protocol):
    """Broadcast ``mine`` from the rank at coordinate ``src`` along ``side`` (every rank passes its
    own block: the root's is sent, the others give the shape); reduce (sum) ``t`` to ``dst``
    along ``side`` (the result on ``dst``, None elsewhere). Both return at once; ``wait`` gives
    the value."""

    def broadcast(self, mine: torch.Tensor, side: Side, src: int) -> Pending: ...

    def reduce(self, t: torch.Tensor, side: Side, dst: int) -> Pending: ...


class _Done:
    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


class _InFlight:
    def __init__(self, work, value):
        self.work, self.value = work, value

    def wait(self):
        self.work.wait()
        return self.value


class DistGrid:
    """:class:`Transport` on the process groups of mesh axes ``a`` (columns) and ``b`` (rows)."""

    def __init__(self, mesh: DeviceMesh, a: int, b: int):
        self.groups = {Side.COL: axis_group(mesh, a), Side.ROW: axis_group(mesh, b)}
        self.me = {Side.COL: mesh.get_local_rank(a), Side.ROW: mesh.get_local_rank(b)}

    def broadcast(self, mine: torch.Tensor, side: Side, src: int) -> Pending:
        buf = (
            mine.contiguous()
            if self.me[side] == src
            else torch.empty_like(mine, memory_format=torch.contiguous_format)
        )
        return _InFlight(dist.broadcast(buf, group=self.groups[side], group_src=src, async_op=True), buf)

    def reduce(self, t: torch.Tensor, side: Side, dst: int) -> Pending:
        buf = t.contiguous()
        work = dist.reduce(buf, group=self.groups[side], group_dst=dst, async_op=True)
        return _InFlight(work, buf) if self.me[side] == dst else _Dropped(work, buf)


class _Dropped:
    """A reduction whose result lands elsewhere: ``buf`` is held until it completes."""

    def __init__(self, work, buf):
        self.work, self.buf = work, buf

    def wait(self):
        self.work.wait()
        return None


def _product(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """One step's block product: ``x w^T`` for a linear's ``[N, K]`` weight, else ``x w``."""
    return F.linear(x, w) if transposed else x @ w


def summa_forward(x: torch.Tensor, w: torch.Tensor, q: int, transposed: bool, t: Transport) -> torch.Tensor:
    """``Y_ij`` from this rank's ``X_ij``, ``W_ij`` (module docstring)."""
    pending = (t.broadcast(x, Side.ROW, 0), t.broadcast(w, Side.COL, 0))
    y = None
    for k in range(q):
        xk, wk = pending[0].wait(), pending[1].wait()
        if k + 1 < q:
            pending = (t.broadcast(x, Side.ROW, k + 1), t.broadcast(w, Side.COL, k + 1))
        part = _product(xk, wk, transposed)
        y = part if y is None else y + part
    return y


def summa_backward(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, q: int, transposed: bool, t: Transport
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dX_ij, dW_ij)`` from ``dY_ij`` (module docstring)."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    got: dict[str, torch.Tensor] = {}

    def collect(reduces) -> None:
        for name, p in reduces:
            v = p.wait()
            if v is not None:
                got[name] = v

    pending = (t.broadcast(x, Side.ROW, 0), t.broadcast(w, Side.COL, 0))
    reduces = ()
    for k in range(q):
        xk, wk = pending[0].wait(), pending[1].wait()
        if k + 1 < q:
            pending = (t.broadcast(x, Side.ROW, k + 1), t.broadcast(w, Side.COL, k + 1))
        x2 = xk.reshape(-1, xk.shape[-1])
        if transposed:  # y = x w^T: dx = dy w, dw = dy^T x
            dx, dw = (dy @ wk), dy2.T @ x2
        else:  # y = x w: dx = dy w^T, dw = x^T dy
            dx, dw = (dy @ wk.T), x2.T @ dy2
        collect(reduces)
        reduces = (("x", t.reduce(dx, Side.ROW, k)), ("w", t.reduce(dw, Side.COL, k)))
    collect(reduces)
    return got["x"], got["w"]


class _Summa(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, a, b, transposed, mesh):
        ctx.save_for_backward(x, w)
        ctx.grid, ctx.transposed = (mesh, a, b), transposed
        return summa_forward(x, w, mesh.size(a), transposed, DistGrid(mesh, a, b))

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        mesh, a, b = ctx.grid
        dx, dw = summa_backward(dy.contiguous(), x, w, mesh.size(a), ctx.transposed, DistGrid(mesh, a, b))
        return dx, dw, None, None, None, None


def summa_matmul(x: torch.Tensor, w: torch.Tensor, a: int, b: int, transposed: bool) -> torch.Tensor:
    """What the generated code calls for a matmul under ``Matmul2D.SUMMA`` on mesh axes ``a``
    (rows of ``x``, ``K`` of ``w``) and ``b`` (``K`` of ``x``, ``N`` of ``w``): ``x w^T``
    (``transposed``: a linear's ``[N, K]`` weight) or ``x w``, without bias."""
    return _Summa.apply(x, w, a, b, transposed, current_mesh())


__all__ = ["DistGrid", "Side", "Transport", "summa_backward", "summa_forward", "summa_matmul"]
