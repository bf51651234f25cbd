"""Lowerings that rewrite an op's arguments for its local pieces and issue no collective: the
values they leave partial or split are reduced or gathered by the reshards of their uses
(``autopar/reshard.py``), priced there. Declared here so that the property test checks that their
code issues nothing of its own.

* ``vocab_parallel_embedding``: the table's rows split over an axis; each rank looks up the ids in
  its block and returns zeros elsewhere (``Partial`` output);
* ``local_index``: an indexed dim split (its index is the identity over it, split alike); each
  rank's index values made local to its block;
* ``split_mean``: a mean over a dim cut in ``k`` pieces is the local mean over ``k`` (``Partial``);
* ``split_mse_loss``: likewise for ``mse_loss``'s mean.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.lowerings import NONE, Lowering, LoweringPlan, register
from autopar.passes.rules import norm_dim
from autopar.placement import is_shard

aten = torch.ops.aten


def _split_dim_axis(spec, dim: int, mesh_shape) -> int | None:
    return next((a for a, p in enumerate(spec) if is_shard(p) and p.dim == dim and mesh_shape[a] > 1), None)


def _embedding(node: fx.Node, s, mesh_shape) -> LoweringPlan | None:
    return NONE if _split_dim_axis(s.ins[0], 0, mesh_shape) is not None else None


def _index(node: fx.Node, s, mesh_shape) -> LoweringPlan | None:
    indices = node.args[1] if len(node.args) > 1 else node.kwargs["indices"]
    for a, p in enumerate(s.ins[0]):
        if is_shard(p) and p.dim < len(indices) and indices[p.dim] is not None and mesh_shape[a] > 1:
            return NONE
    return None


def mean_dims(node: fx.Node) -> set[int]:
    """The dims ``aten.mean`` reduces."""
    nd = len(node.args[0].meta["val"].shape)
    dims = node.args[1] if node.target is aten.mean.dim and len(node.args) > 1 and node.args[1] else range(nd)
    return {norm_dim(d, nd) for d in dims}


def _mean(node: fx.Node, s, mesh_shape) -> LoweringPlan | None:
    reduced = mean_dims(node)
    split = any(is_shard(p) and p.dim in reduced and mesh_shape[a] > 1 for a, p in enumerate(s.ins[0]))
    return NONE if split else None


def _mse(node: fx.Node, s, mesh_shape) -> LoweringPlan | None:
    reduction = node.args[2] if len(node.args) > 2 else node.kwargs.get("reduction", 1)
    split = any(is_shard(p) and mesh_shape[a] > 1 for a, p in enumerate(s.ins[0]))
    return NONE if split and reduction == 1 else None


EMBEDDING = register(Lowering("vocab_parallel_embedding", (aten.embedding.default,), _embedding))
INDEX = register(Lowering("local_index", (aten.index.Tensor,), _index))
MEAN = register(Lowering("split_mean", (aten.mean.dim, aten.mean.default), _mean))
MSE = register(Lowering("split_mse_loss", (aten.mse_loss.default,), _mse))
