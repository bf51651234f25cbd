"""What one op costs beside its own compute: the pieces the cost tables (``passes/costs.py``), the
FP8 pricing (``passes/float8_price.py``) and the plan's pricing (``passes/price.py``) share. The
elements an op's per-element figures count, the least dim of a matmul's local pieces (GEMM
efficiency), the itemsize an op runs in under mixed precision, and the collectives its lowering
issues inside it (``autopar/lowerings``), priced by the comm model."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.fx as fx

from autopar.cost_model.comm import CommModel
from autopar.cost_model.compute import gemm_min_dim
from autopar.lowerings import LoweringPlan, describe, price_calls
from autopar.lowerings.float8 import describe as describe_float8
from autopar.passes.analyze import NodeInfo, tensor_vals
from autopar.passes.strategies import Strategy
from autopar.placement import local_shapes
from autopar.reshard import CollectiveCall
from autopar.trades import Float8


def item_of(dtype: torch.dtype | None) -> int:
    return torch.empty((), dtype=dtype or torch.float32).element_size()


def node_elements(info: NodeInfo, inputs: list[fx.Node]) -> int:
    """``E`` of ``cost_model.compute``: the elements of the node's largest tensor, output or input
    (what its per-element figures count: a loss's logits, not its scalar output)."""
    return max(
        [math.prod(sh) for sh in info.shapes]
        + [t.numel() for a in inputs for t in tensor_vals(a.meta.get("val"))]
    )


def local_gemm_min_dim(
    op: str, inputs: list[fx.Node], s: Strategy | None, mesh_shape: Sequence[int]
) -> int | None:
    """``gemm_min_dim`` of a matmul's local pieces under ``s`` (global shapes without one)."""
    vals = [a.meta.get("val") for a in inputs]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    shapes = [tuple(v.shape) for v in vals]
    if s is not None and len(s.ins) == len(shapes):
        shapes = local_shapes(shapes, s.ins, mesh_shape) or shapes
    return gemm_min_dim(op, shapes)


def run_ratio(node: fx.Node, info: NodeInfo | None) -> float:
    """The itemsize ``node`` runs in (``info``'s dtype: the half type of its autocast op under mixed
    precision, ``passes/precision.py:half_infos``) over its traced one; 1 where either is unknown."""
    val = node.meta.get("val")
    if info is None or info.dtype is None or not isinstance(val, torch.Tensor):
        return 1.0
    return info.dtype.itemsize / val.dtype.itemsize


def lowering_collectives(
    node: fx.Node,
    s: Strategy,
    comm: CommModel,
    compute_s: float = 0.0,
    recipe: Float8 | None = None,
    info: NodeInfo | None = None,
) -> list[tuple[CollectiveCall, float]]:
    """Each collective that the lowering of ``node`` under ``s`` issues inside the op
    (``autopar/lowerings``: the calls codegen's code issues), with its seconds (``priced_calls``);
    ``recipe``: a linear run FP8, whose calls are its amax all-reduces (``lowerings/float8.py``);
    ``info``: the node's as priced, whose dtype the calls that move its operands take (``run_ratio``)."""
    if recipe is not None:
        plan = describe_float8(node, s, comm.mesh_shape, recipe)
        return priced_calls(plan, comm, compute_s) if plan is not None else []
    return priced_calls(describe(node, s, comm.mesh_shape).in_dtype(run_ratio(node, info)), comm, compute_s)


def priced_calls(
    lowered: LoweringPlan, comm: CommModel, compute_s: float
) -> list[tuple[CollectiveCall, float]]:
    """The calls of a lowering's plan with their seconds: what each adds to the step beyond the
    op's own compute ``compute_s`` (forward + backward, per rank), which calls in an overlap window
    hide behind (``lowerings.price_calls``)."""
    if not lowered.calls:
        return []
    return price_calls(lowered.calls, lambda c: comm.time(c.kind, c.nbytes, c.axis, c.group), compute_s)
