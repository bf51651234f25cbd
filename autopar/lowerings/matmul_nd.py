"""2D tensor-parallel matmuls (Optimus, Xu et al. 2021) on a ``q x q`` grid of mesh axes ``a``, ``b``,
and 3D ones (Agarwal et al. 1995, as Colossal-AI's 3D tensor parallelism runs them: Bian et al.
2021) on a ``q x q x q`` cube (the end of this docstring).

Layouts (``Matmul2D``; ``passes/rules/matmul.py:GRID_OPTIONS`` offers them), for a linear
``Y = X W^T + bias`` with ``X [.., M, K]``, ``W [N, K]`` (torch's layout of a linear's weight),
rows ``M`` any batch-like dim of ``X``, and alike for ``mm`` and ``addmm`` (``X [M, K]``,
``W [K, N]``: GPT-2's Conv1D):

* ``X``: rows on ``a``, ``K`` on ``b``; ``W``: ``K`` on ``a``, ``N`` on ``b``; a bias: ``N`` on
  ``b``, its rows (where it has any) on ``a``; ``Y``: rows on ``a``, ``N`` on ``b``.

Rank ``(i, j)`` holds ``X_ij`` and ``W_ij`` and must compute ``Y_ij = sum_k X_ik W_kj``. SUMMA
broadcasts, at step ``k``, ``X_ik`` along its row (axis ``b``) and ``W_kj`` along its column (axis
``a``); ``GATHERED`` runs the ``q`` steps at once: one all-gather of ``X``'s ``K`` blocks over
``b`` and one of ``W``'s over ``a``, then one local linear. Each rank receives what SUMMA's
broadcasts bring it, ``(q - 1) / q`` of the gathered operands; it holds the gathered operands
(``q`` times the local ones) through the op and keeps them for backward.

Calls (byte convention of ``autopar/lowerings``: a gather or reduce-scatter at its gathered size):

* forward: ``ALL_GATHER`` of ``X`` over ``b`` (``q |X_ij|`` bytes), ``ALL_GATHER`` of ``W`` over
  ``a`` (``q |W_ij|``);
* backward: the gathered ``X``'s gradient ``dY_ij W_:j`` is a partial sum over ``b``, the gathered
  ``W``'s ``dY_ij^T X_i:`` one over ``a``: each gather's backward reduce-scatters it
  (``codegen/collectives.py:all_gather`` with ``fused_f``), the same bytes.

Saved bytes: the gathered operands the local linear keeps, beyond the local pieces the traced op
keeps: ``(q - 1) (|X_ij| + |W_ij|)``. None of the calls hides behind compute.

``SUMMA`` (``codegen/summa.py``) runs the ``q`` steps, a block of each operand in flight:

* forward, step ``k``: ``BROADCAST`` of ``X_ik`` over ``b`` (``|X_ij|`` bytes), ``BROADCAST`` of
  ``W_kj`` over ``a`` (``|W_ij|``); steps ``1 .. q-1`` travel while the step before computes:
  each hides behind one step's product, ``1 / (3q)`` of the op's forward + backward compute;
* backward, step ``k``: the two blocks broadcast again, then ``REDUCE`` of the partial ``dX``
  over ``b`` (``|X_ij|``) and of the partial ``dW`` over ``a`` (``|W_ij|``) to their owners; step
  ``k``'s broadcasts and step ``k - 1``'s reductions hide behind one step's two products
  (``2 / (3q)``), step 0's broadcasts and the last step's reductions behind nothing.

It keeps nothing beyond the local blocks the traced op keeps.

3D (``Matmul3D.GATHERED``, ``codegen/lower.py``): rank ``(i, j, l)`` of a ``q x q x q`` cube of
axes ``a`` (depth), ``b``, ``c`` computes one of the ``q^3`` block products ``X_il W_lj`` of the
3D algorithm: ``i`` the rows block, ``j`` the ``N`` block, ``l`` the ``K`` block. Layouts, for a
linear ``X [B, .., S, .., K]`` (``S`` any batch-like dim; ``mm``/``addmm``: ``S`` = ``M``):

* ``X``: ``S`` on ``b``, ``K`` on ``c`` (and, where ``X`` has another batch-like dim, the batch
  on ``a``); ``W``: ``N`` on ``b``, ``K`` on ``c``, whole on ``a``; a bias: ``N`` on ``b``;
  ``Y``: ``S`` on ``c``, ``N`` on ``b`` (the batch on ``a``).

A product of layer ``t`` gives ``Y`` with ``S`` on ``c``: the next layer runs with the roles of
``b`` and ``c`` swapped, as Colossal-AI swaps its input and output groups layer by layer. Each
rank stores ``1/q^3`` of every activation; a weight is stored ``1/q^2`` (whole on the depth
axis, whose gradient sum is data parallelism's all-reduce, priced by the gradient sync), and
``1/q^3`` where ZeRO shards it over the depth axis (Colossal-AI's all-gather of ``W`` over its
weight group forward and reduce-scatter backward: the same bytes). Colossal-AI splits the
flattened rows over two groups; autopar's placements split a dim over one axis, so the two row
splits are two dims (batch and sequence), and a 2-D input (GPT-2's Conv1D) takes the depth
axis for something else.

Calls (gathered sizes): forward ``ALL_GATHER`` of ``X``'s ``S`` blocks over ``b``
(``q |X_local|``), the local product (a partial sum over ``c``), ``REDUCE_SCATTER`` onto ``S``
over ``c`` (``q |Y_local|``), the bias added after; backward the mirror: ``ALL_GATHER`` of
``dY`` over ``c``, ``REDUCE_SCATTER`` of the gathered ``X``'s gradient over ``b``. Saved:
the gathered ``X`` beyond the local one, ``(q - 1) |X_local|``; the partial ``Y`` before its
reduce-scatter (``q |Y_local|``) lives only through the op. None of the calls hides.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from autopar.lowerings import Collective, Lowering, LoweringCall, LoweringPlan, Phase, register
from autopar.placement import Matmul2D, Matmul3D, is_shard, volume_factor

aten = torch.ops.aten
LINEAR = aten.linear.default

# op -> (tensor input of X, tensor input of W, W's K dim): a linear's weight is [N, K], a matrix
# product's right operand (mm, addmm: GPT-2's Conv1D) [K, N]
OPERANDS = {LINEAR: (0, 1, 1), aten.addmm.default: (1, 2, 0), aten.mm.default: (0, 1, 0)}


def grid_axes(node: fx.Node, s) -> tuple[int, int] | None:
    """``(a, b)`` of a 2D matmul's strategy ``s`` (module docstring): ``a`` splits ``X``'s rows and
    ``W``'s ``K``, ``b`` splits ``X``'s ``K`` and ``W``'s ``N``; None for any other strategy."""
    marked = [a for a, v in enumerate(s.via) if isinstance(v, Matmul2D)]
    if len(marked) != 2 or s.via[marked[0]] is not s.via[marked[1]] or node.target not in OPERANDS:
        return None
    xi = OPERANDS[node.target][0]
    x, ndim = s.ins[xi], node.args[xi].meta["val"].dim()
    b = [a for a in marked if is_shard(x[a]) and x[a].dim % ndim == ndim - 1]
    if len(b) != 1:
        return None
    a = marked[0] if marked[1] == b[0] else marked[1]
    return a, b[0]


def is_grid(s) -> bool:
    """Does strategy ``s`` run its op on a grid of two axes (``Matmul2D``) or as a slice of a cube
    (``Matmul3D``)?"""
    return any(isinstance(v, (Matmul2D, Matmul3D)) for v in s.via)


def cube_axes(node: fx.Node, s) -> tuple[int, int, int] | None:
    """``(b, c, d)`` of a 3D matmul's strategy ``s`` (module docstring): ``X``'s dim ``d`` gathered
    over axis ``b``, the output's dim ``d`` reduce-scattered over axis ``c``; None for any other
    strategy."""
    marked = [a for a, v in enumerate(s.via) if isinstance(v, Matmul3D)]
    if len(marked) != 2 or node.target not in OPERANDS:
        return None
    xi = OPERANDS[node.target][0]
    x, ndim = s.ins[xi], node.args[xi].meta["val"].dim()
    b = [a for a in marked if is_shard(x[a]) and x[a].dim % ndim != ndim - 1]
    if len(b) != 1:
        return None
    c = marked[0] if marked[1] == b[0] else marked[1]
    return b[0], c, x[b[0]].dim % ndim


def _blocks(node: fx.Node, s, mesh_shape: Sequence[int], via: Matmul2D):
    """``(a, b, |X_ij|, |W_ij|)`` (bytes) where ``s`` runs ``node`` by ``via``, else None."""
    grid = grid_axes(node, s)
    if grid is None or s.via[grid[0]] is not via:
        return None
    xi, wi, _ = OPERANDS[node.target]
    x, w = node.args[xi].meta["val"], node.args[wi].meta["val"]
    x_local = x.numel() * x.element_size() / volume_factor(s.ins[xi], mesh_shape)
    w_local = w.numel() * w.element_size() / volume_factor(s.ins[wi], mesh_shape)
    return (*grid, x_local, w_local)


def _gathered(node: fx.Node, s, mesh_shape: Sequence[int]):
    blocks = _blocks(node, s, mesh_shape, Matmul2D.GATHERED)
    if blocks is None:
        return None
    a, b, x_local, w_local = blocks
    qa, qb = mesh_shape[a], mesh_shape[b]
    calls = (
        LoweringCall(Collective.ALL_GATHER, b, x_local * qb, Phase.FORWARD),
        LoweringCall(Collective.ALL_GATHER, a, w_local * qa, Phase.FORWARD),
        LoweringCall(Collective.REDUCE_SCATTER, b, x_local * qb, Phase.BACKWARD),
        LoweringCall(Collective.REDUCE_SCATTER, a, w_local * qa, Phase.BACKWARD),
    )
    return LoweringPlan(calls, saved_bytes=(qb - 1) * x_local + (qa - 1) * w_local)


def _summa(node: fx.Node, s, mesh_shape: Sequence[int]):
    blocks = _blocks(node, s, mesh_shape, Matmul2D.SUMMA)
    if blocks is None:
        return None
    a, b, x_blk, w_blk = blocks
    q = mesh_shape[a]
    bcast, reduce = Collective.BROADCAST, Collective.REDUCE
    calls = []
    for k in range(q):  # step k's broadcasts travel while step k - 1 computes
        window, hides = (k, 1 / (3 * q)) if k else (None, 0.0)
        calls += [
            LoweringCall(bcast, b, x_blk, Phase.FORWARD, window, hides),
            LoweringCall(bcast, a, w_blk, Phase.FORWARD, window, hides),
        ]
    for k in range(q):  # and backward, with step k - 1's reductions, while step k - 1 or k computes
        window, hides = (q + k, 2 / (3 * q)) if k else (None, 0.0)
        calls += [
            LoweringCall(bcast, b, x_blk, Phase.BACKWARD, window, hides),
            LoweringCall(bcast, a, w_blk, Phase.BACKWARD, window, hides),
        ]
        if k:
            calls += [
                LoweringCall(reduce, b, x_blk, Phase.BACKWARD, window, hides),
                LoweringCall(reduce, a, w_blk, Phase.BACKWARD, window, hides),
            ]
    calls += [  # the last step's reductions hide behind nothing
        LoweringCall(reduce, b, x_blk, Phase.BACKWARD),
        LoweringCall(reduce, a, w_blk, Phase.BACKWARD),
    ]
    return LoweringPlan(tuple(calls))


def _cube(node: fx.Node, s, mesh_shape: Sequence[int]):
    axes = cube_axes(node, s)
    if axes is None:
        return None
    b, c, _ = axes
    xi = OPERANDS[node.target][0]
    x, y = node.args[xi].meta["val"], node.meta["val"]
    x_local = x.numel() * x.element_size() / volume_factor(s.ins[xi], mesh_shape)
    y_local = y.numel() * y.element_size() / volume_factor(s.out, mesh_shape)
    qb, qc = mesh_shape[b], mesh_shape[c]
    calls = (
        LoweringCall(Collective.ALL_GATHER, b, x_local * qb, Phase.FORWARD),
        LoweringCall(Collective.REDUCE_SCATTER, c, y_local * qc, Phase.FORWARD),
        LoweringCall(Collective.ALL_GATHER, c, y_local * qc, Phase.BACKWARD),
        LoweringCall(Collective.REDUCE_SCATTER, b, x_local * qb, Phase.BACKWARD),
    )
    return LoweringPlan(calls, saved_bytes=(qb - 1) * x_local)


MATMUL_2D = register(Lowering("matmul_2d_gathered", tuple(OPERANDS), _gathered))
SUMMA = register(Lowering("matmul_2d_summa", tuple(OPERANDS), _summa))
MATMUL_3D = register(Lowering("matmul_3d", tuple(OPERANDS), _cube))
