"""ParallelModule: the rank-local module ``autoparallelize`` returns.

It holds this rank's parameter shards (``parameters()`` yields only those, so any torch optimizer
works; build it with ``optimizer(cls, **kwargs)``, which gives every ZeRO stage the optimizer it
needs, ``codegen/zero.py``), takes the same arguments as the original model (the full global
batch on every rank) and returns the same output structure with full tensors. ``full_state_dict()`` gathers the full,
unsharded state under the original model's state-dict names.

The module owns its DeviceMesh (``self.mesh``). ``forward`` runs the generated graph inside
``collectives.bound_mesh(self.mesh)``: each collective the graph calls runs on this mesh and keeps
it in its autograd context for backward (``codegen/collectives.py``), so several parallel modules
on different meshes may run forward and backward in any interleaving in one process. Nothing
stays bound after a call. ``full_output`` and ``full_state_dict`` pass ``self.mesh`` to
``collectives.gather_full``.

Training loop. ``step(**batch)`` runs one step's forward and backward on the global batch and
returns its loss; the optimizer steps as usual::

    for batch in data:
        loss = pmodel.step(**batch)          # or pmodel.step(*args, loss_fn=criterion)
        opt.step()
        opt.zero_grad()

With ``plan.trades.micro_batches = k > 1`` (gradient accumulation, ``codegen/micro_batches.py``)
the module is generated for one micro-batch: ``forward`` takes ``1/k`` of the global batch (a
call with the global batch raises, saying to call ``step``), and ``step`` splits the global batch
into ``k`` micro-batches on dim 0, runs forward and backward on each in turn (one micro-batch's
activations live at a time), and reduces the accumulated gradients across ranks once, in the last
backward (``_set_grad_sync``, ``codegen/grad_sync.py``). With ``k == 1``, ``step`` is one forward
and one backward, the same as ``model(**batch).loss.backward()``.

A plan with pipeline stages builds a ``PipelinedModule`` (``codegen/pipeline.py``), a subclass:
the same ``step``, ``optimizer`` and ``full_state_dict``, run by torch's pipeline schedules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.codegen import collectives as C
from autopar.codegen.agree import agree
from autopar.codegen.micro_batches import batch_size, split_batch
from autopar.codegen.zero import AppliedTrades
from autopar.placement import Spec, is_shard


def local_piece(full: torch.Tensor, spec: Spec, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's piece of ``full`` under ``spec`` (Partial is never used for stored state)."""
    x = full
    for a, p in enumerate(spec):
        if is_shard(p) and mesh.size(a) > 1:
            x = x.chunk(mesh.size(a), dim=p.dim)[mesh.get_local_rank(a)]
    return x.contiguous()


class ParallelModule(torch.nn.Module):
    def __init__(
        self,
        local: fx.GraphModule,
        mesh: DeviceMesh,
        in_spec: pytree.TreeSpec,
        kwarg_order: Sequence[str],
        input_shapes: Sequence[tuple[int, ...]],
        out_spec: pytree.TreeSpec,
        state_specs: dict[str, tuple[str, Spec]],
        aliases: dict[str, str],
        extra_state: dict[str, torch.Tensor],
        device: torch.device,
        plan,
        grad_sync=None,
        output_specs: Sequence[Spec | None] = (),
        zero: AppliedTrades | None = None,
    ):
        super().__init__()
        self.local = local
        self.mesh = mesh
        self.plan = plan
        self._in_spec = in_spec
        self._kwarg_order = list(kwarg_order)
        self._input_shapes = [tuple(s) for s in input_shapes]
        self._out_spec = out_spec
        self._state_specs = state_specs  # canonical FQN -> (attribute name, placement)
        self._aliases = aliases  # every state-dict name -> canonical FQN
        self._extra_state = extra_state  # state the graph never reads: kept as it was
        self._device = device
        self.grad_sync = grad_sync  # codegen/grad_sync.GradSync: the overlapped gradient all-reduces
        # codegen/zero.py: ZeRO (FSDP2 groups, ZeRO-1's data group), autocast, offload, as applied
        self.zero = zero if zero is not None else AppliedTrades()
        # the placement of each output leaf (flattened, as pytree orders them; None: not a tensor):
        # all Replicate unless the plan returns outputs as local pieces (autopar.placement.Outputs)
        self.output_specs = tuple(output_specs)
        self._batch_checked = False  # the batch is compared across ranks at the first call

    @property
    def code(self) -> str:
        """The generated rank-local code."""
        return self.local.code

    def _flat_inputs(self, args, kwargs) -> list:
        """The call's arguments flattened as the example inputs were (keyword arguments in their
        order); TypeError when they are structured otherwise."""
        kwargs = {k: kwargs[k] for k in self._kwarg_order if k in kwargs} | {
            k: v for k, v in kwargs.items() if k not in self._kwarg_order
        }
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise TypeError(
                f"the parallel module was planned for inputs structured as {self._in_spec}, got {spec}; "
                "call it with the same positional/keyword arguments as the example inputs"
            )
        if not self._batch_checked:  # the first call: every rank holds the same global batch
            agree(
                "the batches", [(f"input {i}", t) for i, t in enumerate(flat)],
                "pass the same full global batch on every rank: the module slices each rank's part itself (do "
                "not give each rank its own shard, as DistributedDataParallel wants)",
            )  # fmt: skip
            self._batch_checked = True
        return flat

    def forward(self, *args, **kwargs):
        flat = self._flat_inputs(args, kwargs)
        k = self.micro_batches
        for i, (t, shape) in enumerate(zip(flat, self._input_shapes)):
            if k > 1 and tuple(t.shape) == (shape[0] * k, *shape[1:]):
                raise ValueError(
                    f"input {i} has the global batch's shape {tuple(t.shape)}, but this module runs the plan's "
                    f"{k} micro-batches: forward takes one micro-batch, {shape}. Call pmodel.step(...) with the "
                    "global batch to train (it runs every micro-batch and the backward)"
                )
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"input {i} has shape {tuple(t.shape)} but the plan was made for {shape}: plans are specialized "
                    "to the example inputs' shapes; re-plan for this shape"
                )
        flat = [t.to(self._device) if isinstance(t, torch.Tensor) else t for t in flat]
        with C.bound_mesh(self.mesh), self.zero.autocast(self._device.type):
            outs = self.local(*flat)
        return pytree.tree_unflatten(list(outs), self._out_spec)

    @property
    def micro_batches(self) -> int:
        """How many micro-batches ``step`` splits the global batch into (``plan.trades``)."""
        trades = getattr(self.plan, "trades", None)
        return trades.micro_batches if trades is not None else 1

    def step(self, *args, loss_fn: Callable[[Any], torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        """Forward and backward of one training step on the GLOBAL batch (the arguments ``forward``
        takes, with the full batch); returns the step's loss, detached. The optimizer step is the
        caller's.

        The batch runs as ``k = micro_batches`` micro-batches: every tensor argument split on dim 0
        into ``k`` equal parts, forward and backward on each in turn, the gradients accumulated in
        ``.grad`` and reduced across ranks once, in the last backward. The loss of a micro-batch is
        ``loss_fn(out)`` when given, else ``out.loss`` (Hugging Face style outputs), else ``out``
        when it is a scalar tensor; each is divided by ``k`` before its backward, so the
        accumulated gradient is that of the mean of the micro-batches' losses, and the loss
        returned is that mean. This equals the gradient and loss of the global batch exactly when
        every micro-batch's loss is a mean over equally many elements (e.g. a token-mean
        cross-entropy with no ignored labels); a loss that is a sum, or a mean over a number of
        elements that varies between micro-batches, gets a differently weighted gradient. With
        ``k == 1``: one forward and one backward of the unscaled loss."""
        k = self.micro_batches
        if k > 1:
            batch, micro = batch_size((args, kwargs), 1), self._input_shapes[0][0]
            if batch != micro * k:
                raise ValueError(
                    f"step takes the global batch, {micro * k} rows ({k} micro-batches of {micro}, the plan's), "
                    f"got {batch}; plans are specialized to the example inputs' shapes: re-plan for this batch"
                )
            parts = split_batch((args, kwargs), k)
        else:
            parts = [(args, kwargs)]
        losses = []
        try:
            for i, (a, kw) in enumerate(parts):
                self._set_grad_sync(i == k - 1)
                loss = _loss_of(self(*a, **kw), loss_fn)
                (loss / k if k > 1 else loss).backward()
                losses.append(loss.detach())
                del loss  # this micro-batch's graph is freed before the next forward
        finally:
            self._set_grad_sync(True)
        if self.grad_sync is not None:
            self.grad_sync.finish()  # what a last backward that reached no bucketed parameter left
        return torch.stack(losses).mean() if k > 1 else losses[0]

    def _set_grad_sync(self, enabled: bool) -> None:
        """Whether the next backward reduces gradients across ranks (True) or only accumulates them
        locally (False): ``step`` turns it off for every micro-batch but the last. The one hook
        point of gradient accumulation: it toggles the bucketed data-parallel all-reduces
        (``GradSync.set_requires_gradient_sync``); FSDP2's reduce-scatters (ZeRO 2 and 3) stay on,
        so that gradients accumulate sharded (``codegen/zero.py``)."""
        if self.grad_sync is not None:
            self.grad_sync.set_requires_gradient_sync(enabled)

    def optimizer(self, optimizer_class: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
        """THE way to build the optimizer: ``optimizer_class(self.parameters(), **kwargs)`` as the
        plan's ZeRO stage needs it (``codegen/zero.py``): a ``ZeroRedundancyOptimizer`` over the
        data-parallel group for ZeRO-1 (each rank keeps and steps the state of its share), the
        plain optimizer over the FSDP2-sharded ``DTensor`` parameters for ZeRO-2/3 (on the host
        under offload), the plain optimizer otherwise. E.g. ``pmodel.optimizer(torch.optim.AdamW,
        lr=3e-4)``."""
        return self.zero.optimizer(self.parameters(), optimizer_class, **kwargs)

    @torch.no_grad()
    def full_output(self, piece: torch.Tensor, index: int) -> torch.Tensor:
        """The whole output from this rank's ``piece`` of output leaf ``index`` (``output_specs``
        order); collective: every rank calls it. For plans made with ``outputs=Outputs.LOCAL``."""
        spec = self.output_specs[index]
        if spec is None:
            raise ValueError(f"output {index} is not a tensor")
        return C.gather_full(piece, spec, self.mesh)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) tensors under the original model's state-dict names; collective on every rank."""
        full = {
            fqn: C.gather_full(_whole_on_data_axes(getattr(self.local, attr)).detach(), spec, self.mesh)
            for fqn, (attr, spec) in self._state_specs.items()
        }
        out = {}
        for name, fqn in self._aliases.items():
            out[name] = full[fqn] if fqn in full else self._extra_state[name]
        return out


def _whole_on_data_axes(t: torch.Tensor) -> torch.Tensor:
    """A parameter FSDP2 shards over the data axes (ZeRO-2/3: a ``DTensor``) gathered back to the
    plan's local piece (collective over the data group); any other tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss_of(out, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
    """The loss ``step`` runs backward from (``step``'s docstring)."""
    if loss_fn is not None:
        return loss_fn(out)
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    raise TypeError(
        f"step needs a scalar loss: the model returns {type(out).__name__} with no .loss and is not a scalar "
        "tensor; pass loss_fn=, a function of the output that returns the micro-batch's mean loss"
    )
