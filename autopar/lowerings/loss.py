"""Losses whose mean spans split rows, and the output projection fused with its loss.

``cross_entropy_mean``: ``aten.cross_entropy_loss`` with ``reduction='mean'`` on rows split over
some axes: each rank computes its rows' loss sum and count of counted tokens as one tensor
``[sum, count]`` (float32 at least, ``codegen/local_ops.py:loss_sum_and_count``), all-reduced once
per split axis forward (``2 * max(4, itemsize)`` bytes), then divided. Backward issues nothing (the
all-reduce's gradient is the identity). A sum or ``'none'`` needs no collective. Where the loss is
only returned, over one axis (``returned_alone``), the all-reduce runs off the step's path
(``codegen/module.py:defer_output_sums``) and is priced so (``LoweringCall.deferred``).

``linear_cross_entropy``: the fused output projection + loss (``passes/rules/fused.py``), rows
split on some axes and the vocabulary (the weight's rows) on others:

* vocabulary split (``kernels/cross_entropy.py:vocab_parallel_linear_cross_entropy``): the rank's
  rows in chunks of ``chunk_rows_for(rows, V_local, chunk_rows)``; per chunk of ``c`` rows, a
  float32 all-reduce (max) of the row maxima, ``4 c`` bytes, over each vocabulary axis in mesh
  order, then a float32 all-reduce (sum) of ``[sum of exponentials, target logit]``, ``8 c``
  bytes, over each in turn; nothing backward (``h``'s gradient shares are summed by the Megatron
  "f" on ``h``, a reshard);
* a mean over split rows: then the ``[sum, count]`` all-reduce (8 bytes) on each rows axis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.fx as fx

from autopar.kernels.cross_entropy import chunk_rows_for
from autopar.lowerings import Collective, Lowering, LoweringCall, LoweringPlan, Phase, register
from autopar.placement import is_shard

aten = torch.ops.aten
FUSED_CROSS_ENTROPY = torch.ops.autopar.linear_cross_entropy.default


def _pair_bytes(dtype: torch.dtype) -> int:
    """``[sum, count]`` in the loss's accumulation dtype (float32 at least)."""
    return 2 * torch.promote_types(dtype, torch.float32).itemsize


def split_rows_axes(s, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The axes of more than one rank over which ``cross_entropy_loss`` under ``s`` is split."""
    return tuple(a for a, sp in enumerate(s.split_axes()) if sp and mesh_shape[a] > 1)


def cross_entropy_reduction(node: fx.Node) -> int:
    """``aten.cross_entropy_loss``'s reduction (0 none, 1 mean, 2 sum)."""
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)


def returned_alone(node: fx.Node, rows: Sequence[int]) -> bool:
    """Whether the ``[sum, count]`` all-reduce of a token-mean loss over ``rows`` runs off the
    step's path (``LoweringCall.deferred``): the loss is one tensor the graph only returns, its
    mean over one axis, as ``codegen/module.py:defer_output_sums`` rewrites it (the count
    all-reduced from the top of the forward, the sum in backward's first gradient bucket). That
    rewrite also needs the labels to come from the inputs alone, which a loss's labels do (a
    target computed from the model's state keeps the blocking all-reduce, priced as deferred)."""
    users = list(node.users)
    return (
        len(rows) == 1
        and len(users) == 1
        and users[0].op == "output"
        and not isinstance(node.meta.get("val"), (tuple, list))
    )


def _cross_entropy_mean(node: fx.Node, s, mesh_shape: tuple[int, ...]) -> LoweringPlan | None:
    split = split_rows_axes(s, mesh_shape)
    if not split or cross_entropy_reduction(node) != 1:
        return None
    nbytes = _pair_bytes(node.args[0].meta["val"].dtype)
    off = returned_alone(node, split)
    return LoweringPlan(
        tuple(LoweringCall(Collective.ALL_REDUCE, a, nbytes, Phase.FORWARD, deferred=off) for a in split)
    )


CROSS_ENTROPY_MEAN = register(
    Lowering("cross_entropy_mean", (aten.cross_entropy_loss.default,), _cross_entropy_mean)
)


def fused_axes(s, mesh_shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The fused loss's rows axes and vocabulary axes under ``s`` (axes of more than one rank)."""
    live = [a for a, n in enumerate(mesh_shape) if n > 1]
    return tuple(a for a in live if is_shard(s.ins[0][a])), tuple(a for a in live if is_shard(s.ins[1][a]))


def fused_reduction(node: fx.Node) -> str:
    return node.args[4] if len(node.args) > 4 else node.kwargs.get("reduction", "mean")


def _vocab_parallel_calls(node: fx.Node, rows: Sequence[int], vocab: Sequence[int], mesh_shape) -> list:
    h, w = node.args[0].meta["val"], node.args[1].meta["val"]
    chunk = node.args[5] if len(node.args) > 5 else node.kwargs.get("chunk_rows", 0)
    n = int(h.shape[0]) // math.prod(mesh_shape[a] for a in rows)
    v_local = int(w.shape[0]) // math.prod(mesh_shape[a] for a in vocab)
    step = chunk_rows_for(n, v_local, chunk)
    out = []
    for start in range(0, n, step):
        c = min(step, n - start)
        out += [LoweringCall(Collective.ALL_REDUCE, a, 4 * c, Phase.FORWARD) for a in vocab]
        out += [LoweringCall(Collective.ALL_REDUCE, a, 8 * c, Phase.FORWARD) for a in vocab]
    return out


def _linear_cross_entropy(node: fx.Node, s, mesh_shape: tuple[int, ...]) -> LoweringPlan | None:
    rows, vocab = fused_axes(s, mesh_shape)
    mean_rows = bool(rows) and fused_reduction(node) == "mean"
    if not mean_rows and not vocab:
        return None
    calls = _vocab_parallel_calls(node, rows, vocab, mesh_shape) if vocab else []
    if mean_rows:  # the loss sum and count of this rank's rows, float32 (the kernels' loss dtype)
        off = returned_alone(node, rows)
        calls += [LoweringCall(Collective.ALL_REDUCE, a, 8, Phase.FORWARD, deferred=off) for a in rows]
    return LoweringPlan(tuple(calls))


LINEAR_CROSS_ENTROPY = register(
    Lowering("linear_cross_entropy", (FUSED_CROSS_ENTROPY,), _linear_cross_entropy)
)
