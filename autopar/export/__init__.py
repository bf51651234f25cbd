"""A plan's data- and tensor-parallel part as PyTorch's own objects, for users who run their own loop.

``to_torch(plan, model, example_inputs)`` returns a ``TorchPlan``: the device mesh (shape and dim
names), a ``parallelize_module`` plan (module path -> ``ColwiseParallel`` / ``RowwiseParallel``
from ``torch.distributed.tensor.parallel``) for the tensor-parallel mesh dim, and how to wrap the
data-parallel dim (``replicate``, or FSDP2's ``fully_shard`` for the plan's ZeRO stage).
``TorchPlan.apply`` does both on a model; the caller then trains it as any PyTorch module.

How the plan is read. Each mesh axis of more than one rank is ``tensor`` (parameters split),
``data`` (inputs split on their first dim, values with them) or ``replica`` (nothing split: every
rank computes the same step); one of each at most. On the tensor axis ``t``
(``tensor_axis.py`` walks the traced graph in order):

* an ``nn.Linear`` whose weight is ``Shard(0)`` (bias ``Shard(0)``) is ``ColwiseParallel``, one
  whose weight is ``Shard(1)`` (bias ``Replicate``) is ``RowwiseParallel``; an ``nn.Embedding``
  with ``Shard(1)`` (hidden split) is colwise, with ``Shard(0)`` (vocabulary split) rowwise;
* a styled module's ``input_layouts`` is the layout its input arrives in, its ``output_layouts``
  the placement its consumers take its output in (the graph's outputs: ``Replicate`` unless the
  plan returns local pieces; a pending sum is reduced there). Where the consumers disagree, or the
  plan gathers the split output only further on inside another module's forward, the module
  gives its output whole and the ops between run on whole values (the same values; ``notes``);
* every other op runs, in PyTorch, on the local tensors it is given. That computes what the plan
  computes where each input comes in the layout the plan takes it in (no resharding between), an
  output is split only where an input is and never a pending sum, and no plain parameter meets a
  split value (its gradient would be one rank's part of the sum the plan all-reduces), or where
  every input is whole (the op then runs whole). The walk checks exactly that, node by node.

On the data axis every parameter is whole, each op takes its inputs in the layout they come in
(the rank's rows) and none reduces over the whole batch inside itself: PyTorch's data parallelism
runs each op on the rank's own rows and averages the gradients (the plan's step where the loss is
a mean over the batch). ZeRO 0 is wrapped with FSDP2's ``replicate``, 1-3 with ``fully_shard``.

What PyTorch's module plans cannot say raises ``ExportError`` naming the node, module or axis:
pipeline stages; inputs split off their first dim or values split with whole parameters and
inputs (sequence or context parallelism); two axes splitting parameters, or the batch; a split
parameter of a module that is no ``nn.Linear`` / ``nn.Embedding``, or a weight used by more than
its module's one op (tied weights, fused kernels); any check above that fails; a batch statistic
synchronized over the data axis (batch norm, a mean over all tokens). What the loop does itself
without changing the math (recomputation, micro-batches, mixed precision's autocast, fused
kernels, collective matmuls, the outputs a loss-only plan skips) is listed in ``TorchPlan.notes``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from autopar.export.layouts import ExportError, grid_matmul, same, seq_attention, text
from autopar.export.tensor_axis import TensorWalk
from autopar.passes.replay import traced_as_planned
from autopar.passes.rules import tensor_inputs
from autopar.placement import Matmul2D, Matmul3D, Outputs, SeqAttention, is_replicate, is_shard, via_from_str
from autopar.plan import NodeDecision, Plan, Site
from autopar.trades import Offload, ZeroStage

__all__ = ["DataParallel", "ExportError", "TorchPlan", "to_torch"]

TENSOR = "tensor"
DATA = "data"
REPLICA = "replica"  # an axis on which every rank computes the same thing


class DataParallel(enum.Enum):
    """How the data-parallel mesh dim is wrapped: ``REPLICATE`` (ZeRO 0: FSDP2's ``replicate``,
    DDP's math on the machinery that composes with tensor-parallel DTensors) or ``FULLY_SHARD``
    (FSDP2, ZeRO 1-3: parameters resharded after forward for stage 3 only)."""

    NONE = "none"
    REPLICATE = "replicate"
    FULLY_SHARD = "fully_shard"


@dataclass(frozen=True)
class TorchPlan:
    """A plan's data- and tensor-parallel part in PyTorch's terms (module docstring)."""

    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    parallelize_plan: dict[str, ParallelStyle] = field(default_factory=dict)
    data_parallel: DataParallel = DataParallel.NONE
    reshard_after_forward: bool = False
    offload_to_cpu: bool = False  # FSDP2's CPUOffloadPolicy (either offload of the plan)
    notes: tuple[str, ...] = ()

    @property
    def tensor_dim(self) -> str | None:
        return TENSOR if TENSOR in self.mesh_dim_names else None

    @property
    def data_dim(self) -> str | None:
        return DATA if DATA in self.mesh_dim_names else None

    def device_mesh(self, device_type: str = "cuda"):
        """``init_device_mesh`` of this plan's shape and dim names (in an initialized process group)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.mesh_dim_names)

    def apply(self, model: torch.nn.Module, mesh) -> torch.nn.Module:
        """``parallelize_module`` on the tensor dim, then the data-parallel wrapping, in place;
        returns ``model``. Feed each data-parallel rank its own rows of the batch."""
        if self.parallelize_plan:
            parallelize_module(model, mesh[TENSOR], self.parallelize_plan)
        if self.data_parallel is DataParallel.REPLICATE:
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(model, mesh=mesh[DATA])
        elif self.data_parallel is DataParallel.FULLY_SHARD:
            from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

            offload = CPUOffloadPolicy() if self.offload_to_cpu else OffloadPolicy()
            fully_shard(
                model,
                mesh=mesh[DATA],
                reshard_after_forward=self.reshard_after_forward,
                offload_policy=offload,
            )
        return model


def to_torch(plan: Plan, model: torch.nn.Module, example_inputs) -> TorchPlan:
    """The data- and tensor-parallel part of ``plan`` (made for ``model`` and ``example_inputs``)
    as a ``TorchPlan``; ``ExportError`` where the plan decides what PyTorch's plan styles cannot
    express (module docstring)."""
    if plan.pipeline.enabled:
        raise ExportError(
            f"the plan runs {plan.pipeline.stages} pipeline stages ({plan.pipeline.describe()}); a "
            "parallelize_module plan has none: run it with autoparallelize, or plan with pipeline_stages=1"
        )
    grid = next(
        (d for d in plan.decisions if any(isinstance(v, (Matmul2D, Matmul3D)) for v in via_from_str(d.via))),
        None,
    )
    if grid is not None:
        raise grid_matmul(grid)
    tg = traced_as_planned(model, example_inputs, plan)
    plan.check_matches(tg.fingerprint(), plan.world_size)
    names = _axis_names(plan)
    styles: dict[str, ParallelStyle] = {}
    notes = _notes(plan)
    if TENSOR in names:
        walk = TensorWalk(plan, model, tg.graph, names.index(TENSOR))
        styles = walk.styles()
        if walk.whole:
            notes.append(
                f"{len(walk.whole)} ops the plan computes split or as pending sums on the tensor dim run whole "
                f"under PyTorch's plan (the same values): {', '.join(walk.whole[:8])}"
                + (" ..." if len(walk.whole) > 8 else "")
            )
    dp = DataParallel.NONE
    if DATA in names:
        _check_data_axis(plan, tg.graph, names.index(DATA))
        dp = DataParallel.REPLICATE if plan.trades.zero_stage is ZeroStage.NONE else DataParallel.FULLY_SHARD
        notes.append(
            "data parallel: feed each rank of the data dim its own rows of the batch; PyTorch averages the "
            "gradients, which equals the plan's step where the loss is a mean over the batch"
        )
        if plan.trades.zero_stage is ZeroStage.OPTIMIZER:
            notes.append(
                "ZeRO-1 runs as FSDP2 with reshard_after_forward=False (it also shards the gradients)"
            )
    for name, size in zip(names, plan.mesh_shape):
        if name.startswith(REPLICA) and size > 1:
            notes.append(f"mesh dim {name!r}: every rank of it computes the same step on the same batch")
    return TorchPlan(
        mesh_shape=tuple(plan.mesh_shape), mesh_dim_names=names, parallelize_plan=styles, data_parallel=dp,
        reshard_after_forward=plan.trades.zero_stage is ZeroStage.PARAMETERS,
        offload_to_cpu=plan.trades.offload is not Offload.NONE, notes=tuple(notes),
    )  # fmt: skip


def _axis_names(plan: Plan) -> tuple[str, ...]:
    """Per mesh axis: ``tensor`` where parameters are split; ``data`` where the batch is (inputs
    split on their first dim and the step's values with them) or ZeRO shards; ``replica`` where
    nothing is (inputs the plan gathers at once included, and every axis of one rank; a second
    such axis is ``replica<axis>``)."""
    n = len(plan.mesh_shape)
    live = {a for a in range(n) if plan.mesh_shape[a] > 1}  # on one rank every placement is the same
    params = [d for d in plan.decisions if d.role == "param"]  # buffers are whole in PyTorch's plans
    split = {a for d in params for a, p in enumerate(d.output_spec) if not is_replicate(p)} & live
    computed = {a for d in plan.decisions if d.role == "activation" for a, p in enumerate(d.output_spec)
                if not is_replicate(p)} & live  # fmt: skip
    batch = set(plan.trades.data_axes) & live
    for d in plan.decisions:
        if d.role != "input":
            continue
        for a, p in enumerate(d.output_spec):
            if a not in live:
                continue
            if is_shard(p) and p.dim % max(len(d.shape), 1) != 0 and a not in split:
                raise ExportError(
                    f"the plan splits input {d.target or d.name} on its dim {p.dim} over mesh axis {a} "
                    "(sequence or context parallelism), which a parallelize_module plan cannot express: "
                    "plan with AxisRole.DATA or AxisRole.TENSOR on that axis"
                )
            if is_shard(p) and a in computed:
                batch.add(a)
    both = split & batch
    if both:
        a = min(both)
        raise ExportError(
            f"mesh axis {a} splits both parameters and the batch; PyTorch's plans split one or the other "
            "per mesh dim: plan with axis_roles giving it AxisRole.DATA or AxisRole.TENSOR"
        )
    for what, axes in (("parameters", split), ("the batch", batch)):
        if len(axes) > 1:
            raise ExportError(
                f"mesh axes {sorted(axes)} all split {what}; the export maps one mesh dim to each of tensor "
                "and data parallelism: plan with axis_roles giving one axis AxisRole.TENSOR, one AxisRole.DATA"
            )
    for a in sorted(computed - split - batch):
        d = next(d for d in plan.decisions if d.role == "activation" and not is_replicate(d.output_spec[a]))
        raise ExportError(
            f"the plan splits values over mesh axis {a} (node {d.name}, {d.module or d.op}: {d.output}) with "
            "every parameter and input whole there (sequence or context parallelism), which a "
            "parallelize_module plan cannot express: plan with AxisRole.DATA or AxisRole.TENSOR on that axis"
        )
    names = [TENSOR if a in split else DATA if a in batch else REPLICA for a in range(n)]
    replicas = [a for a in range(n) if names[a] == REPLICA]
    for a in replicas[1:]:
        names[a] = f"{REPLICA}{a}"
    return tuple(names)


def _notes(plan: Plan) -> list[str]:
    t = plan.trades
    notes = []
    if t.recompute.value != "none":
        notes.append(
            f"recomputation {t.recompute.value}: wrap the blocks with activation checkpointing yourself"
            + (
                ""
                if t.recompute_blocks is None
                else f" (only the first {t.recompute_blocks} of each pipeline stage)"
            )
        )
    if t.micro_batches > 1:
        notes.append(f"{t.micro_batches} micro-batches: accumulate gradients over them in your loop")
    if t.precision.mixed:
        notes.append(f"mixed precision {t.precision.value}: run forward and backward under torch.autocast")
    if t.offload is Offload.PARAMETERS:
        notes.append(
            "parameter offload: apply fully_shard with CPUOffloadPolicy to each repeated block yourself before "
            "apply() shards the root, so that the blocks stream from host memory one at a time"
        )
    if plan.kernels:
        kinds = sorted({u.kernel.value for u in plan.kernels})
        notes.append(f"fused kernels {', '.join(kinds)} are not exported; PyTorch runs the aten ops")
    if plan.overlap_matmuls:
        notes.append("collective matmuls are not exported; PyTorch runs the collectives and matmuls apart")
    if plan.outputs == Outputs.LOSS.value:
        notes.append("the plan computes the loss alone; PyTorch computes every output")
    return notes


def _check_data_axis(plan: Plan, graph: fx.Graph, axis: int) -> None:
    """No resharding on the data axis but the loss's and the gradients' reductions: every op takes
    each value as it comes (the rank's own rows, or whole), and no op reduces over the whole batch
    inside itself (a collective of its own)."""
    for d in plan.decisions:
        via = via_from_str(d.via)
        if axis < len(via) and isinstance(via[axis], SeqAttention):
            raise seq_attention(d, axis)
        for c in d.collectives:
            if c.axis == axis and c.site is Site.INSIDE:
                what = f"reduces over the whole batch inside the op ({c.kind.value}: a mean over all tokens, batch norm)"
                raise _not_data_parallel(d, axis, what)
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        d = plan.decision(n.name)
        for i, a in enumerate(tensor_inputs(n)):
            have, need = plan.decision(a.name).output_spec[axis], d.input_specs[i][axis]
            if not is_replicate(have) and not same(have, need, _ndim(a)):
                raise _not_data_parallel(
                    d, axis, f"takes its input {a.name} as {text(need)} where it is {text(have)}"
                )


def _not_data_parallel(d: NodeDecision, axis: int, what: str) -> ExportError:
    return ExportError(
        f"on the data axis {axis}, node {d.name} ({d.op}{', module ' + d.module if d.module else ''}) {what}; "
        "PyTorch's data parallelism runs every op on the rank's own rows and averages the gradients: run "
        "this plan with autoparallelize"
    )


def _ndim(n: fx.Node) -> int:
    v = n.meta.get("val")
    return v.dim() if isinstance(v, torch.Tensor) else 0
