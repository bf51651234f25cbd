"""Lower: rewrite the traced global graph into a rank-local graph with explicit collectives.

For every node, in order:

1. each tensor input is resharded from its producer's placement to the placement the chosen
   strategy requires (``emit_reshard``: one call per collective, named by mesh axis), followed by
   Megatron's "f" on the axes where a Replicate input meets a split op (its gradient is partial);
   uses of one tensor that need the same reshard take the one the first of them made
   (``passes/grad_sync.py:reshard_key``), so q, k and v reduce their input's gradient once;
2. the op runs on local pieces: the same aten op, except for *lowerings* (``LOWERINGS``) that
   rewrite arguments that refer to global sizes (views, expands), or run the op the way its
   registered lowering says (``autopar/lowerings``: a mean over split rows, ring or all-to-all
   attention, vocabulary-parallel losses and embeddings, batch-norm statistics): the emitters
   below take which lowering runs and over which axes from its description, and issue exactly
   the collectives it describes, which the cost tables price
   (``tests/test_lowering_registry.py`` checks the two agree, call for call); an op of a
   data-parallel region (``OwnRows``, ``passes/data_region.py``) runs with its arguments as traced
   on one rank's rows (``local_call``), no lowering, no collective; with
   ``overlap_matmuls``, a linear whose input's reshard ends with an all-gather runs it as
   ``all_gather_linear`` (the reshard's earlier steps emitted as they are), and one whose output's
   only use reshards it starting with a reduce-scatter as ``linear_reduce_scatter`` (the use then
   reshards the rest of the way): collective matmuls, where ``passes/collective_matmul.py`` says
   they fuse, the same test the cost tables price them by; linears that share one gathered input
   read by linears alone (Q, K and V) run as one ``all_gather_linears`` that keeps the shard and
   gathers it again in backward (``regathers``); under mixed precision an activation only GEMMs
   read is cast to the half type before its reshards (``passes/half_reshard.py``);
3. outputs are gathered to Replicate (full tensors) before they leave the module, or, with
   ``Outputs.LOCAL``, leave as this rank's piece (pending sums reduced).

Parameters and buffers become ``get_attr`` of the module's ``DTensor`` state, read as local pieces
(``collectives.local``) where used; user inputs arrive whole, or as this rank's slice of the batch
(``collectives.batch_slice`` takes either), and are sliced locally. No device is named: every
device argument is the rank's, read at run time (``collectives.run_device``, ``device_free``). The generated ``.code`` is straight-line: local aten ops and ``autopar`` collectives.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import Shard

from autopar.codegen import collectives as C
from autopar.codegen import context_parallel as CP
from autopar.codegen import experts as EX
from autopar.codegen import experts_nodes as EXN
from autopar.codegen import local_ops as L
from autopar.codegen import summa as SM
from autopar.errors import PlanMismatchError
from autopar.kernels import ops as kernel_ops
from autopar.kernels.moe import MoeOperands
from autopar.lowerings import float8 as F8
from autopar.lowerings import lowering_of
from autopar.lowerings.attention import ALL_TO_ALL, RING, SDPA_ARGS, is_causal, query_rows_axis
from autopar.lowerings.batch_norm import BATCH_NORM
from autopar.lowerings.experts import (
    EXPERT_ALL_TO_ALL,
    EXPERT_NODE_ALL_TO_ALL,
    NODES_META,
    experts_axis,
    ranks_per_node,
)
from autopar.lowerings.local import EMBEDDING, INDEX, MEAN, MSE, mean_dims
from autopar.lowerings.loss import CROSS_ENTROPY_MEAN, LINEAR_CROSS_ENTROPY, fused_axes
from autopar.lowerings.matmul_nd import MATMUL_2D, MATMUL_3D, OPERANDS, SUMMA, cube_axes, grid_axes, is_grid
from autopar.passes.collective_matmul import LINEAR, gather_step, regathers, scatter_step, sole_use
from autopar.passes.grad_sync import deferred_sources, emitted_f_axes, plan_uses, reshard_key
from autopar.passes.half_reshard import casts_before_reshard
from autopar.passes.local_rows import local_call
from autopar.passes.rules import map_args, tensor_inputs
from autopar.passes.rules.shape import arange_range
from autopar.passes.strategies import Strategy
from autopar.passes.trace import AUTOCAST_REGION, Role, TracedGraph, retarget_region
from autopar.placement import (
    ExpertDispatch,
    Outputs,
    R,
    Spec,
    is_shard,
    local_shape,
    output_placement,
    own_rows_axes,
    replicated,
)
from autopar.reshard import ReshardStep, StepKind, reshard_plan
from autopar.trades import Float8

aten = torch.ops.aten
kernel_ops.load()  # the fused ops a plan may call (passes/fuse.py), lowered below where they split


def mangle(fqn: str) -> str:
    return "p__" + fqn.replace(".", "__")


# the function of codegen/collectives.py each kind of reshard step calls, and its arguments
_STEP_CALLS = {
    StepKind.ALL_GATHER: lambda x, s: (C.all_gather, (x, s.dim, s.axis, s.fused_f)),
    StepKind.CHUNK: lambda x, s: (C.chunk, (x, s.dim, s.axis)),
    StepKind.ALL_REDUCE: lambda x, s: (C.all_reduce, (x, s.axis)),
    StepKind.REDUCE_SCATTER: lambda x, s: (C.reduce_scatter, (x, s.dim, s.axis)),
    StepKind.TO_PARTIAL: lambda x, s: (C.to_partial, (x, s.axis)),
    StepKind.F: lambda x, s: (C.f, (x, s.axis)),
}


def emit_reshard(
    g: fx.Graph,
    x: fx.Node,
    src: Spec,
    dst: Spec,
    mesh_shape: Sequence[int],
    fops=(),
    made: dict | None = None,
) -> fx.Node:
    """Emit the steps of the reshard plan that moves ``x`` from ``src`` to ``dst`` and applies the
    "f" of axes ``fops`` (``autopar/reshard.py:reshard_plan``; the cost model prices the same
    steps), one collective call per step. ``made``: collectives emitted so far, by (function,
    arguments): a chain that starts as an earlier one did takes its steps instead of running them
    again (the logits gathered over the vocabulary for the loss, then over the batch for the
    caller). Every step is linear, so its gradient is the sum of its consumers'."""
    return emit_steps(g, x, reshard_steps(src, dst, mesh_shape, fops), made)


def reshard_steps(src: Spec, dst: Spec, mesh_shape: Sequence[int], fops=()) -> tuple[ReshardStep, ...]:
    """The steps of the reshard plan that ``emit_reshard`` emits (``autopar/reshard.py``)."""
    return reshard_plan(tuple(src), tuple(dst), tuple(mesh_shape), 0.0, tuple(sorted(set(fops)))).steps


def emit_steps(g: fx.Graph, x: fx.Node, steps: Sequence[ReshardStep], made: dict | None = None) -> fx.Node:
    """One collective call per step, in order, each taking the one before (``emit_reshard``)."""
    for step in steps:
        fn, args = _STEP_CALLS[step.kind](x, step)
        if made is None:
            x = g.call_function(fn, args)
        else:
            if (fn, args) not in made:
                made[(fn, args)] = g.call_function(fn, args)
            x = made[(fn, args)]
    return x


# ------------------------------------------------------------------------------------------------
# lowerings: ops whose local call differs from the global one
# ------------------------------------------------------------------------------------------------

LowerFn = Callable[[fx.Graph, fx.Node, tuple, dict, Strategy, Sequence[int]], fx.Node]
LOWERINGS: dict = {}


def lowering(*ops):
    def deco(fn):
        for op in ops:
            LOWERINGS[op] = fn
        return fn

    return deco


def _out_shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(int(s) for s in node.meta["val"].shape)


@lowering(
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
    aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default,
)  # fmt: skip
def _lower_sized_view(g, node, args, kwargs, s, mesh_shape):
    size = list(local_shape(_out_shape(node), s.out, mesh_shape))
    return g.call_function(node.target, (args[0], size) + tuple(args[2:]), kwargs)


@lowering(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _lower_squeeze(g, node, args, kwargs, s, mesh_shape):
    # a local piece may have size 1 where the global dim does not: squeeze by the global shape
    return g.call_function(
        aten.view.default, (args[0], list(local_shape(_out_shape(node), s.out, mesh_shape)))
    )


@lowering(aten.zeros.default, aten.ones.default, aten.full.default)
def _lower_sized_factory(g, node, args, kwargs, s, mesh_shape):
    size = list(local_shape(_out_shape(node), s.out, mesh_shape))
    return g.call_function(node.target, (size,) + tuple(args[1:]), kwargs)


@lowering(aten.arange.default, aten.arange.start, aten.arange.start_step)
def _lower_arange(g, node, args, kwargs, s, mesh_shape):
    a = _axis_sharding(s.out, 0)
    if a is None or mesh_shape[a] == 1:
        return g.call_function(node.target, args, kwargs)
    start, _, step = arange_range(node.target, args, kwargs)
    coord = g.call_function(C.coordinate, (a,))
    kw = {k: v for k, v in kwargs.items() if k not in ("start", "end", "step")}
    return g.call_function(L.arange_piece, (start, step, _out_shape(node)[0] // mesh_shape[a], coord), kw)


@lowering(aten.index.Tensor)
def _lower_index(g, node, args, kwargs, s, mesh_shape):
    """An indexed dim of ``x`` split (``passes/rules/shape.py``: its index is the identity over it,
    split alike): each rank's index values are global rows of its own block, made local."""
    x, indices = args[0], list(args[1] if len(args) > 1 else kwargs["indices"])
    if INDEX.describe(node, s, tuple(mesh_shape)) is None:
        return g.call_function(node.target, args, kwargs)
    src = node.args[0].meta["val"].shape
    for a, p in enumerate(s.ins[0]):
        if is_shard(p) and p.dim < len(indices) and indices[p.dim] is not None and mesh_shape[a] > 1:
            rows = int(src[p.dim]) // mesh_shape[a]
            coord = g.call_function(C.coordinate, (a,))
            indices[p.dim] = g.call_function(L.local_rows, (indices[p.dim], coord, rows))
    rest = {k: v for k, v in kwargs.items() if k != "indices"}
    return g.call_function(node.target, (x, indices), rest)


@lowering(aten.batch_norm.default)
def _lower_batch_norm(g, node, args, kwargs, s, mesh_shape):
    """Training batch norm on a split batch (or any split non-channel dim): the per-channel sum,
    then the sum of squared deviations from the global mean, each all-reduced over the split
    axes (two passes, as accurate as the one-device op), so every rank normalizes with the whole
    batch's statistics and updates its running statistics alike. torch's SyncBatchNorm does this
    on CUDA only (its stats kernels have no CPU form), hence by hand. Forward all-reduces, and
    Megatron's "f" on each sum all-reduces its gradient's per-rank parts backward."""
    plan = BATCH_NORM.describe(node, s, tuple(mesh_shape))
    if plan is None:
        return g.call_function(node.target, args, kwargs)
    split = plan.axes()
    names = ["input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps"]
    bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    x = bound["input"]
    shape = node.args[0].meta["val"].shape
    count = math.prod(int(n) for n in shape) // int(shape[1])
    total = g.call_function(L.channel_sum, (x,))
    for a in split:
        total = g.call_function(C.f, (g.call_function(C.all_reduce, (total, a)), a))
    squares = g.call_function(L.channel_squared_deviations, (x, total, count))
    for a in split:
        squares = g.call_function(C.f, (g.call_function(C.all_reduce, (squares, a)), a))
    rest = tuple(bound.get(k) for k in ("weight", "bias", "running_mean", "running_var"))
    return g.call_function(
        L.batch_norm_of_sums,
        (x, total, squares, count, *rest, bound.get("momentum", 0.1), bound.get("eps", 1e-5)),
    )


@lowering(aten.mean.dim, aten.mean.default)
def _lower_mean(g, node, args, kwargs, s, mesh_shape):
    out = g.call_function(node.target, args, kwargs)
    if MEAN.describe(node, s, tuple(mesh_shape)) is None:
        return out
    reduced = mean_dims(node)
    k = 1
    for a, p in enumerate(s.ins[0]):
        if is_shard(p) and p.dim in reduced:
            k *= mesh_shape[a]
    # mean over a dim cut in k equal pieces: the sum over ranks of (local mean / k) is the global mean
    return g.call_function(aten.div.Tensor, (out, k)) if k > 1 else out


def batch_axis(spec: Spec, mesh_shape: Sequence[int]) -> int | None:
    """The mesh axis of more than one rank that splits an input's dim 0 (its batch) under
    ``spec``: its ranks each take a slice of the rows (``collectives.batch_slice``)."""
    a = _axis_sharding(spec, 0)
    return a if a is not None and mesh_shape[a] > 1 else None


def _axis_sharding(spec, dim: int) -> int | None:
    """The first mesh axis that shards tensor dim ``dim`` under ``spec``: the only one, or, where the
    batch splits on two axes (nested: ``passes/strategies.py:nest_axes``), the outer one; an input
    is sliced on it and chunked on the inner one by its reshard (arange is never nested)."""
    for a, p in enumerate(spec):
        if is_shard(p) and p.dim == dim:
            return a
    return None


@lowering(aten.mse_loss.default)
def _lower_mse_loss(g, node, args, kwargs, s, mesh_shape):
    out = g.call_function(node.target, args, kwargs)
    if MSE.describe(node, s, tuple(mesh_shape)) is None:
        return out
    k = math.prod(mesh_shape[a] for a, p in enumerate(s.ins[0]) if is_shard(p))
    # a mean of k equal pieces: the sum over ranks of (local mean / k) is the global mean
    return g.call_function(aten.div.Tensor, (out, k))


@lowering(aten.embedding.default)
def _lower_embedding(g, node, args, kwargs, s, mesh_shape):
    if EMBEDDING.describe(node, s, tuple(mesh_shape)) is None:  # table not cut by rows: the plain lookup
        return g.call_function(node.target, args, kwargs)
    a = _axis_sharding(s.ins[0], 0)
    padding_idx = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
    coord = g.call_function(C.coordinate, (a,))
    return g.call_function(L.vocab_parallel_embedding, (args[0], args[1], coord, padding_idx))


@lowering(aten.scaled_dot_product_attention.default)
def _lower_sdpa(g, node, args, kwargs, s, mesh_shape):
    """Attention with its query rows split on the sequence, as its lowering
    (``autopar/lowerings/attention.py``) says: a ring, all-to-alls, or this rank's causal rows."""
    how = lowering_of(node, s, mesh_shape)
    if how is None:
        return g.call_function(node.target, args, kwargs)
    a = query_rows_axis(node, s, mesh_shape)
    full = dict(zip(SDPA_ARGS, args))
    full.update(kwargs)
    if how is RING:
        return g.call_function(
            CP.ring_attention,
            (full["query"], full["key"], full["value"], full.get("attn_mask"), a, is_causal(node), full.get("scale")),
        )  # fmt: skip
    if how is ALL_TO_ALL:
        return _lower_ulysses(g, node, full, a)
    coord = g.call_function(C.coordinate, (a,))
    return g.call_function(
        L.causal_attention_rows,
        (full["query"], full["key"], full["value"], coord, full.get("dropout_p", 0.0), full.get("scale"),
         full.get("enable_gqa", False)),
    )  # fmt: skip


def _lower_ulysses(g, node, full: dict, a: int):
    """DeepSpeed-Ulysses on mesh axis ``a``: Q, K, V re-cut from sequence to heads (one all-to-all
    each; a single K/V head is all-gathered instead, its gradient reduce-scattered), attention on
    whole sequences of this rank's heads, the output re-cut back to the sequence."""
    q = g.call_function(C.all_to_all, (full["query"], 1, 2, a))
    one_kv_head = node.args[1].meta["val"].shape[1] == 1
    k, v = (
        g.call_function(C.all_gather, (full[x], 2, a, True))
        if one_kv_head
        else g.call_function(C.all_to_all, (full[x], 1, 2, a))
        for x in ("key", "value")
    )
    rest = {x: full[x] for x in SDPA_ARGS[3:] if x in full}
    out = g.call_function(aten.scaled_dot_product_attention.default, (q, k, v), rest)
    return g.call_function(C.all_to_all, (out, 2, 1, a))


@lowering(torch.ops.autopar.moe_experts.default)
def _lower_moe_experts(g, node, args, kwargs, s, mesh_shape):
    """A mixture-of-experts layer with its experts split over an axis
    (``autopar/lowerings/experts.py``): its pairs sent to their experts' ranks and back by
    all-to-all (flat, or once per node where the axis spans nodes), or, tokens whole, this rank's
    experts alone (a summand)."""
    how = lowering_of(node, s, mesh_shape)
    if how is None and any(v is ExpertDispatch.NODE_ALL_TO_ALL for v in s.via):
        raise PlanMismatchError(
            f"{node.name}: the plan dispatches its experts once per node over an axis of {tuple(mesh_shape)} "
            f"whose group spans no whole nodes of {node.meta.get(NODES_META)} devices: re-plan for this cluster"
        )
    if how is None:
        return g.call_function(node.target, args, kwargs)
    op = MoeOperands(*args, **kwargs)  # one argument of the call: FX keeps a NamedTuple's nodes
    if how is EXPERT_NODE_ALL_TO_ALL:
        a = experts_axis(s, mesh_shape)
        m, _ = ranks_per_node(node, mesh_shape, a)
        return g.call_function(EXN.expert_parallel_nodes, (op, a, m))
    call = EX.expert_parallel if how is EXPERT_ALL_TO_ALL else EX.local_experts
    return g.call_function(call, (op, experts_axis(s, mesh_shape)))


@lowering(aten.cross_entropy_loss.default)
def _lower_cross_entropy(g, node, args, kwargs, s, mesh_shape):
    plan = CROSS_ENTROPY_MEAN.describe(node, s, tuple(mesh_shape))
    if plan is None:
        return g.call_function(node.target, args, kwargs)
    logits, target = args[0], args[1]
    ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
    # the loss's dtype at run time (the rule validator runs float64), read before the logits'
    # last use so that they are not kept through the all-reduce
    dtype = g.call_function(getattr, (logits, "dtype"))
    # the local loss sum and token count, all-reduced together: one collective per split axis
    pair = g.call_function(L.loss_sum_and_count, (logits, target, ignore))
    for a in plan.axes():
        pair = g.call_function(C.all_reduce, (pair, a))
    return g.call_function(L.mean_of_sum_and_count, (pair, dtype))


@lowering(torch.ops.autopar.linear_cross_entropy.default)
def _lower_linear_cross_entropy(g, node, args, kwargs, s, mesh_shape):
    """The fused output projection + loss (``passes/rules/fused.py``): rows split on some axes,
    the vocabulary on others. A mean over split rows is the all-reduced local sum and token count,
    as for ``cross_entropy_loss``; the vocabulary split is the vocabulary-parallel form, whose
    collectives run inside the op."""
    h, w, target, ignore, reduction, chunk = args
    if LINEAR_CROSS_ENTROPY.describe(node, s, tuple(mesh_shape)) is None:  # whole here: autocast's operands
        return g.call_function(L.linear_cross_entropy, (h, w, target, ignore, reduction, chunk))
    rows, vocab = fused_axes(s, mesh_shape)
    if rows and reduction == "mean":
        pair = g.call_function(L.fused_loss_sum_and_count, (h, w, target, ignore, chunk, vocab))
        for a in rows:
            pair = g.call_function(C.all_reduce, (pair, a))
        loss = g.call_function(L.mean_of_sum_and_count, (pair, torch.float32))
    else:
        loss = g.call_function(
            C.vocab_parallel_cross_entropy, (h, w, target, ignore, reduction, chunk, vocab)
        )
    return g.call_function(L.loss_alone, (loss,)) if isinstance(node.meta["val"], tuple) else loss


@lowering(*OPERANDS)
def _lower_matmul(g, node, args, kwargs, s, mesh_shape):
    """A 2D or 3D matmul (``autopar/lowerings/matmul_nd.py``). 3D: ``_lower_cube``. ``GATHERED``: ``X``'s ``K`` blocks
    gathered over axis ``b``, ``W``'s over axis ``a``, one local op; each gather's backward
    reduce-scatters its operand's gradient (a partial sum over the other blocks' outputs).
    ``SUMMA``: its ``q`` broadcast steps (``codegen/summa.py``), then the bias added."""
    how = lowering_of(node, s, mesh_shape)
    if how is MATMUL_3D:
        return _lower_cube(g, node, args, kwargs, s)
    if how is not MATMUL_2D and how is not SUMMA:
        return g.call_function(node.target, args, kwargs)
    a, b = grid_axes(node, s)
    xi, wi, wk = OPERANDS[node.target]
    if how is SUMMA:
        y = g.call_function(SM.summa_matmul, (args[xi], args[wi], a, b, node.target is LINEAR))
        return _add_bias(g, node, args, kwargs, y)
    args = list(args)
    args[xi] = g.call_function(C.all_gather, (args[xi], node.args[xi].meta["val"].dim() - 1, b, True))
    args[wi] = g.call_function(C.all_gather, (args[wi], wk, a, True))
    return g.call_function(node.target, tuple(args), kwargs)


def _add_bias(g, node, args, kwargs, y):
    """The bias term of a matmul whose product ``y`` was computed without it: a linear's bias
    added, an ``addmm``'s ``beta * bias + alpha * y``; ``y`` itself for ``mm``."""
    if node.target is LINEAR:
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        return y if bias is None else g.call_function(aten.add.Tensor, (y, bias))
    if node.target is aten.addmm.default:
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        bias = args[0] if beta == 1 else g.call_function(aten.mul.Tensor, (args[0], beta))
        y = y if alpha == 1 else g.call_function(aten.mul.Tensor, (y, alpha))
        return g.call_function(aten.add.Tensor, (bias, y))
    return y


def _lower_cube(g, node, args, kwargs, s):
    """A 3D matmul (``Matmul3D``, ``autopar/lowerings/matmul_nd.py``): ``X``'s ``d`` blocks
    gathered over axis ``b`` (backward: its gradient, a partial sum over ``b``'s ``N`` blocks,
    reduce-scattered), the product without bias (a partial sum over axis ``c``'s ``K`` blocks)
    reduce-scattered onto ``d`` over ``c`` (backward: ``dY`` gathered), then the bias term."""
    b, c, d = cube_axes(node, s)
    xi, wi, _ = OPERANDS[node.target]
    x = g.call_function(C.all_gather, (args[xi], d, b, True))
    if node.target is LINEAR:
        part = g.call_function(aten.linear.default, (x, args[wi]))
    else:
        part = g.call_function(aten.mm.default, (x, args[wi]))
    y = g.call_function(C.reduce_scatter, (part, d, c))
    return _add_bias(g, node, args, kwargs, y)


def _emit_gather_linear(
    g, args, kwargs, x: fx.Node, step: ReshardStep, call, regather: bool, made: dict
) -> fx.Node:
    """``all_gather_linear`` of the linear's input ``x`` (before its last reshard step, the
    all-gather ``step``) with its weight and bias; where later uses share the gather (``call``:
    its ``made`` key), the gathered input is its second output and theirs; else, where the linear
    is its tensor's only use (``regather``), it keeps the shard and gathers again in backward."""
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if call is None:
        return g.call_function(
            C.all_gather_linear, (x, args[1], bias, step.dim, step.axis, step.fused_f), {"regather": regather}
        )
    fused = g.call_function(
        C.all_gather_linear, (x, args[1], bias, step.dim, step.axis, step.fused_f), {"keep_gathered": True}
    )
    made[call] = g.create_node("call_function", operator.getitem, (fused, 1), name="gathered")
    return g.call_function(operator.getitem, (fused, 0))


# ------------------------------------------------------------------------------------------------


def _run_device(g: fx.Graph) -> fx.Node:
    return g.call_function(C.run_device, ())


def _run_device_type(g: fx.Graph) -> fx.Node:
    return g.call_function(C.run_device_type, ())


def device_free(sub: fx.GraphModule) -> fx.GraphModule:
    """A higher-order op's submodule that names no device: its device arguments and autocast
    device type read at run time (``passes/trace.py:retarget_region``)."""
    return retarget_region(sub, _run_device, _run_device_type)


def lower(
    tg: TracedGraph,
    choice: dict[str, Strategy],
    mesh_shape: Sequence[int],
    attrs: dict[str, torch.Tensor],
    deferred: dict[str, tuple[int, ...]] | None = None,
    outputs: Outputs = Outputs.FULL,
    overlap_matmuls: bool = False,
    float8: dict[str, Float8] | None = None,
    half: torch.dtype | None = None,
) -> fx.GraphModule:
    """Return the rank-local GraphModule; ``attrs`` maps mangled names to local parameter/buffer
    shards. The code names no device (``collectives.run_device``, ``device_free``).
    ``deferred``: parameter placeholder -> axes whose "f" is left out because the accumulated
    gradient is all-reduced after backward (``passes/grad_sync.py``, ``codegen/grad_sync.py``).
    ``overlap_matmuls``: a linear and the all-gather before it, or the reduce-scatter after it, run
    as one collective matmul where ``passes/collective_matmul.py`` says they fuse (``Plan.overlap_matmuls``).
    ``float8``: the linears that run FP8, by node name, with their recipes (``Plan.float8_linears``):
    each runs ``codegen/float8.py:float8_linear`` with the amax axes its description gives
    (``autopar/lowerings/float8.py``), never as a collective matmul. ``half``: the autocast dtype
    under mixed precision (else None): an activation whose every use is an autocast GEMM is cast
    to it once, before its reshards (``passes/half_reshard.py``), so they move the half copy."""
    # the parameters' and, under the same axes, their replicated chains' (passes/grad_sync.py)
    deferred = deferred_sources(tg, choice, deferred or {})
    float8 = float8 or {}
    if float8:  # torchao, imported only for a plan that runs FP8
        from autopar.codegen.float8 import float8_linear
    src_graph = tg.graph
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    spec: dict[fx.Node, Spec] = {}
    # collectives emitted so far, by (function, arguments): uses that need the same reshard take
    # the first one's, and chains that start alike share their first steps (emit_reshard)
    made: dict[tuple, fx.Node] = {}
    roles = {p.name: p for p in tg.placeholders}
    state_leaves: set[fx.Node] = set()  # the parameters' and buffers' placeholders
    root = torch.nn.Module()
    for name, t in attrs.items():
        if isinstance(t, torch.nn.Parameter):
            root.register_parameter(name, t)
        else:
            root.register_buffer(name, t)
    r = replicated(len(mesh_shape))

    # a parameter or buffer resharded for a use: (leaf, key) -> the chain's last node
    state_made: dict[tuple, fx.Node] = {}
    # activations resharded as their half copy (passes/half_reshard.py): leaf -> the cast, made
    # at the first use that reshards it, taken by the others
    half_leaves = {n for n in src_graph.nodes if casts_before_reshard(n)} if half is not None else set()
    casts: dict[fx.Node, fx.Node] = {}

    def moved(leaf: fx.Node, steps: Sequence[ReshardStep]) -> fx.Node:
        """What ``leaf``'s reshard of ``steps`` starts from: its half copy where every use casts it
        so anyway and a collective runs, else the tensor itself."""
        if leaf not in half_leaves or not steps:
            return env[leaf]
        if leaf not in casts:
            casts[leaf] = g.call_method("to", (env[leaf], half))
        return casts[leaf]

    def reshard(fops, leaf: fx.Node, need: Spec, user: fx.Node) -> fx.Node:
        """``leaf`` in placement ``need`` for ``user``: the collectives an earlier use with the same
        key made (the same chain emits the same calls), or new ones where there is no key
        (passes/grad_sync.py:reshard_key: ``user`` writes to its inputs). A parameter or buffer
        (a ``DTensor``) is read as its local piece (``collectives.local``) right before the use
        that needs it, so that it lives where that use does (a block's own parameter stays in
        the block, ``codegen/blocks.py``; a tied one is read in each pipeline chunk)."""
        key = reshard_key(leaf, spec[leaf], need, fops, user)
        if leaf not in state_leaves:
            steps = reshard_steps(spec[leaf], need, mesh_shape, fops)
            return emit_steps(g, moved(leaf, steps), steps, made if key is not None else None)
        if key is not None and (leaf, key) in state_made:
            return state_made[(leaf, key)]
        x = g.call_function(C.local, (env[leaf],))
        out = emit_reshard(g, x, spec[leaf], need, mesh_shape, fops)
        if key is not None:
            state_made[(leaf, key)] = out
        return out

    # reshards that several uses share (``reshard_key``): a collective matmul that gathers for the
    # first of them hands the gathered input to the others
    shared_keys: set[tuple] = set()
    groups: dict[tuple, list] = {}  # a shared reshard's uses, in graph order
    if overlap_matmuls:
        for u in plan_uses(tg, choice, deferred, outputs):
            key = reshard_key(u.inp, choice[u.src].out, u.need, u.fops, u.user)
            groups.setdefault(key, []).append(u)
        shared_keys = {k for k, us in groups.items() if k is not None and len(us) > 1}
    # the outputs of linears computed by an earlier one's stacked collective matmul (stack_linears)
    stacked: dict[fx.Node, fx.Node] = {}

    def stackable(key) -> list[fx.Node] | None:
        """The linears sharing the gather of ``key``, where they run as one collective matmul over
        their stacked weights (Megatron's fused QKV): each takes the tensor as input 0 through a
        fused gather (``passes/collective_matmul.py``), none is 2D or FP8, their weights (and
        biases, all or none) are parameters, and the tensor has no other use (``regathers``:
        then the stacked matmul keeps the shard alone); else None."""
        users = [u.user for u in groups.get(key, ())]
        if len(users) < 2 or not regathers(users[0], 0, groups[key][0].inp):
            return None
        for u in users:
            if u.target is not LINEAR or is_grid(choice[u.name]) or u.name in float8:
                return None
            steps = reshard_steps(
                spec[groups[key][0].inp], choice[u.name].ins[0], mesh_shape, groups[key][0].fops
            )
            if gather_step(u, 0, steps, choice[u.name].out) is None:
                return None
            ins = tensor_inputs(u)
            if any(a not in state_leaves for a in ins[1:]) or len(ins) != len(tensor_inputs(users[0])):
                return None
        return users

    def stack_linears(users: list[fx.Node], x: fx.Node, step: ReshardStep, first: list) -> fx.Node:
        """One ``all_gather_linears`` of ``x`` with the ``users``' weights (and biases),
        re-gathering in backward; its outputs theirs (``stacked``). ``first``: the first user's
        weight (and bias), resharded already. Returns the first's output."""
        ws, bs = [first[0]], first[1:]
        for u in users:
            su = choice[u.name]
            ins = tensor_inputs(u)
            if u is not users[0]:
                for j, (leaf, into) in enumerate(zip(ins[1:], (ws, bs)), start=1):
                    fops = emitted_f_axes(su, j, leaf, deferred.get(leaf.name, ()))
                    into.append(reshard(fops, leaf, su.ins[j], u))
        parts = g.call_function(C.all_gather_linears, (x, ws, bs or None, step.dim, step.axis, step.fused_f))
        for j, u in enumerate(users):
            out = g.call_function(operator.getitem, (parts, j))
            out.meta["traced"] = u.name
            stacked[u] = out
        return stacked[users[0]]

    def gather_input(fops, leaf: fx.Node, need: Spec, user: fx.Node):
        """Input 0 of the linear ``user`` up to the all-gather a collective matmul runs for it
        (its reshard's earlier steps emitted), that step, and the gather's ``made`` key where
        later uses share it; None where none fuses, or an earlier use gathered it already."""
        steps = reshard_steps(spec[leaf], need, mesh_shape, fops)
        step = gather_step(user, 0, steps, choice[user.name].out)
        if step is None:
            return None
        key = reshard_key(leaf, spec[leaf], need, fops, user)
        shared = made if key is not None else None
        x = emit_steps(g, moved(leaf, steps), steps[:-1], shared)
        call = _STEP_CALLS[StepKind.ALL_GATHER](x, step)
        if shared is not None and call in shared:
            return None
        if key in shared_keys and (users := stackable(key)) is not None:
            return x, step, users
        return x, step, call if key in shared_keys else None, regathers(user, 0, leaf)

    def scatter_after(node: fx.Node, s: Strategy) -> ReshardStep | None:
        """The reduce-scatter a collective matmul runs after the linear ``node`` for its one use."""
        use = sole_use(node)
        if use is None:
            return None
        user, k = use
        need = choice[user.name]
        fops = emitted_f_axes(need, k, node, deferred.get(node.name, ()))
        return scatter_step(node, user, k, reshard_steps(s.out, need.ins[k], mesh_shape, fops))

    def map_device(a):
        # the device the rank runs on, read at run time: the code names none (collectives.run_device)
        return _run_device(g) if isinstance(a, torch.device) else a

    for node in src_graph.nodes:
        if node.op == "placeholder":
            info = roles[node.name]
            s = choice[node.name]
            if info.role is Role.INPUT:
                x = g.placeholder(node.name)
                x.meta = dict(node.meta)
                src = r
                a = batch_axis(s.out, mesh_shape)
                if a is not None:  # the batch's rows: the whole batch sliced, or this rank's slice
                    x = g.call_function(C.batch_slice, (x, a, _out_shape(node)[0]))
                    src = tuple(Shard(0) if b == a else R for b in range(len(mesh_shape)))
                env[node] = emit_reshard(g, x, src, s.out, mesh_shape)
            else:
                env[node] = g.get_attr(mangle(info.target))
                state_leaves.add(node)
            spec[node] = s.out
        elif node.op == "get_attr":
            value = getattr(tg.graph_module, node.target)
            setattr(root, node.target, device_free(value) if isinstance(value, fx.GraphModule) else value)
            env[node] = g.get_attr(node.target)
        elif node.op == "call_function" and node.target is operator.getitem:
            env[node] = g.call_function(operator.getitem, (env[node.args[0]], node.args[1]))
            spec[node] = spec[node.args[0]]
        elif node.op == "call_function" and node in stacked:  # computed by an earlier stacked matmul
            env[node] = stacked[node]
            spec[node] = choice[node.name].out
        elif node.op == "call_function":
            s = choice[node.name]
            # a 2D or 3D linear gathers inside its own lowering, an FP8 one casts first: no
            # collective matmul around either
            recipe = float8.get(node.name)
            fuse = overlap_matmuls and node.target is LINEAR and not is_grid(s) and recipe is None
            gather = []  # all_gather_linear's input, step and made key (gather_input)

            def reshard_in(k, leaf, s=s, node=node, fuse=fuse, gather=gather):
                fops = emitted_f_axes(s, k, leaf, deferred.get(leaf.name, ()))
                if fuse and k == 0 and leaf not in state_leaves:
                    hit = gather_input(fops, leaf, s.ins[0], node)
                    if hit is not None:
                        gather.append(hit)
                        return hit[0]
                return reshard(fops, leaf, s.ins[k], node)

            # an op of a data-parallel region runs as traced on this rank's rows: no lowering
            own_rows = bool(own_rows_axes(s.via))
            call = local_call(node) if own_rows else None
            args, kwargs = map_args(node, reshard_in, env.__getitem__, map_device, call)
            if node.target is AUTOCAST_REGION and AUTOCAST_REGION is not None:  # its device type, at run time
                args = (_run_device_type(g), *args[1:])
            fn = None if own_rows else LOWERINGS.get(node.target)
            out_spec = s.out
            scatter = scatter_after(node, s) if fuse else None
            if recipe is not None:
                if not F8.eligible(node, s, mesh_shape):
                    raise PlanMismatchError(
                        f"node {node.name}: the plan runs it FP8 ({recipe.value}), which its placement "
                        "does not allow (autopar/lowerings/float8.py); re-plan"
                    )
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                axes = F8.amax_axes(node, s, recipe)
                out = g.call_function(float8_linear, (args[0], args[1], bias, recipe.value, axes))
            elif gather and len(gather[0]) == 3:  # the linears that share the gather, stacked
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                out = stack_linears(
                    gather[0][2], *gather[0][:2], [args[1]] + ([bias] if bias is not None else [])
                )
            elif gather:
                out = _emit_gather_linear(g, args, kwargs, *gather[0], made)
            elif scatter is not None:  # the linear's one use takes it reduce-scattered
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                out = g.call_function(C.linear_reduce_scatter, (*args[:2], bias, scatter.dim, scatter.axis))
                out_spec = tuple(Shard(scatter.dim) if a == scatter.axis else p for a, p in enumerate(s.out))
            else:
                out = (
                    fn(g, node, args, kwargs, s, mesh_shape)
                    if fn
                    else g.call_function(node.target, args, kwargs)
                )
            out.meta["traced"] = node.name  # for debugging and tests: which traced node this computes
            env[node] = out
            spec[node] = out_spec
        elif node.op == "output":
            outs = []
            for leaf in pytree.tree_leaves(node.args[0]):
                if isinstance(leaf, fx.Node) and isinstance(leaf.meta.get("val"), torch.Tensor):
                    outs.append(reshard((), leaf, output_placement(spec[leaf], outputs), node))
                else:
                    outs.append(env[leaf] if isinstance(leaf, fx.Node) else leaf)
            g.output(outs)
    g.lint()
    return fx.GraphModule(root, g, class_name="RankLocal")
