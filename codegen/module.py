"""ParallelModule: the rank-local module ``autoparallelize`` returns.

It holds this rank's parameter shards as ``DTensor``s with the plan's placements (``parameters()``
yields only those, so any torch optimizer works, and ``torch.nn.utils.clip_grad_norm_`` sees the
whole model; build the optimizer with ``optimizer(cls, **kwargs)``, which gives every ZeRO stage
the optimizer it needs, ``codegen/zero.py``), takes the same arguments as the original model (the
full global batch on every rank, or each data-parallel rank's slice of it: ``data_rank``,
``data_world``) and returns the same output structure with full tensors. ``state_dict()`` is
keyed by the original model's names, sharded (for ``torch.distributed.checkpoint``,
``codegen/state.py``); ``full_state_dict()`` gathers the full, unsharded state under them.

Feeding data (``codegen/feeding.py``): every input that carries the batch may be given whole on
every rank or as this rank's slice (``data_rank`` of ``data_world``), whatever the plan does with
it; where the ranks were fed slices, the inputs the plan keeps whole are gathered first. Errors
name the inputs as the call does ("labels").

The module owns its DeviceMesh (``self.mesh``). ``forward`` runs the generated graph inside
``collectives.bound_mesh(self.mesh)``: each collective the graph calls runs on this mesh and keeps
it in its autograd context for backward (``codegen/collectives.py``), so several parallel modules
on different meshes may run forward and backward in any interleaving in one process. Nothing
stays bound after a call. ``full_output`` and ``full_state_dict`` pass ``self.mesh`` to
``collectives.gather_full``.

Collective methods called on one rank. ``full_state_dict``, ``full_output`` and ``full_grads``
gather over every rank of the mesh, whatever the plan (so a loop that works under one plan works
under every other): ``if rank == 0: torch.save(pmodel.full_state_dict(), ...)`` cannot work.
These, ``forward``, ``step`` and a backward through the forward's outputs are the module's
collective calls. With ``check_calls`` (off by default: a few round trips to the store per call
from every rank), where the plan issues collectives, every rank of the mesh enters each together
(``agree.all_entered``, through the store: no collective). Ranks that
make different calls at the same point raise ``CollectiveCallError`` at once, naming the calls;
where some ranks do not come within ``entry_timeout_s`` seconds, those that came raise it; every
other rank of the job then raises ``PeerFailedError`` (``codegen/failures.py``), rather than
abort in the backend or hang.

The returned loss. A data-parallel plan returns the whole batch's loss, summed across ranks
(``defer_output_sums``): its all-reduce starts where the graph computes it and is waited for where
the caller reads it, so nothing blocks on it. With ``loss_rides`` (``AUTOPAR_LOSS_RIDES=1``; off
by default) it costs no collective of its own where backward runs: the forward leaves it pending
(``collectives.riding``) and backward's first gradient bucket all-reduces it with the gradients
(``codegen/grad_sync.py``, "The loss rides"), as ``DistributedDataParallel`` runs one collective a
step; read after backward, it is there. Where no backward follows (``torch.no_grad``, eval, the
sync turned off to accumulate) the forward starts its all-reduce itself. A read before backward
sums it on its own: a collective, so read it there on every rank or on none (with
``check_calls``, a rank that does alone raises ``CollectiveCallError``). Off by default because on
gloo CPU ranks a step measured slower with it (backward about 1.5 ms longer on the tiny Llama,
``benchmarks/README.md``, "The loss riding in the bucket"), though it runs one collective fewer.

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

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.codegen import collectives as C
from autopar.codegen import local_ops as L
from autopar.codegen import state as S
from autopar.codegen.agree import ENTRY_TIMEOUT_S, agree, all_entered, collective_section, enter_backward
from autopar.codegen.feeding import Feeding, InputsError
from autopar.codegen.local_params import LocalLeaf, drop_copies, refresh_leaves, wait_params
from autopar.codegen.loss_weights import LossWeights, inputs_chain
from autopar.codegen.micro_batches import MicroBatchError, batch_size, split_batch
from autopar.codegen.zero import AppliedTrades
from autopar.lowerings.experts import PackedSplit
from autopar.placement import Spec
from autopar.plan_axes import split_axes


class ParallelModule(torch.nn.Module):
    # how long ``full_state_dict``, ``full_output`` and ``full_grads`` wait for every rank of the
    # mesh to call them before raising ``CollectiveCallError`` (module docstring); ranks that
    # legitimately reach them far apart (one evaluates alone first) need it longer
    entry_timeout_s: float = ENTRY_TIMEOUT_S
    # whether ``forward``, ``step`` and a backward through the forward's outputs are entered by
    # every rank together (a few round trips to rank 0's store per call, from every rank: a
    # debugging aid, as PyTorch's TORCH_DISTRIBUTED_DEBUG=DETAIL checks of collectives are, not a
    # default a job of thousands of ranks can afford). Off, a rank that made another collective call
    # still raises: the failed rank aborts its groups, and its peers' blocked collectives break when
    # its process exits, as ``PeerFailedError`` (``codegen/failures.py``). ``AUTOPAR_CHECK_CALLS=1``
    # turns it on for every module.
    check_calls: bool = os.environ.get("AUTOPAR_CHECK_CALLS", "") not in ("", "0")
    # the returned loss rides in backward's first gradient bucket (module docstring, "The returned
    # loss"): off by default, measured slower on gloo CPU ranks (benchmarks/README.md)
    loss_rides: bool = os.environ.get("AUTOPAR_LOSS_RIDES", "") not in ("", "0")
    # whether the generated forward computes on the parameters' plain leaves (shared storage, the
    # gradient moved to the DTensor parameter's .grad: codegen/local_params.py) rather than through
    # DTensor.to_local; False (AUTOPAR_LOCAL_LEAVES=0 for every module) puts the parameters
    # themselves in the autograd graph, as torch.autograd.grad(loss, pmodel.parameters()) needs
    local_leaves: bool = os.environ.get("AUTOPAR_LOCAL_LEAVES", "1") != "0"

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
        batch_axes: Sequence[int | None] = (),
        arg_names: Sequence[str] = (),
        leaves: Sequence[LocalLeaf] = (),
        stored: dict[str, PackedSplit] | None = None,
        loss_weights: LossWeights | None = None,
    ):
        super().__init__()
        # how ``step`` weighs its micro-batches' losses (codegen/loss_weights.py; None: equally);
        # its label count also gives the forward's token count where every rank holds the batch
        self._loss_weights = loss_weights
        # the whole batch's label count the next forward's ``all_reduce_started`` takes as known
        # (``step``: its micro-batch's, summed over the ranks with the step's weights); None: the
        # forward counts it itself where it can (``_known_count``)
        self._step_count: torch.Tensor | None = None
        # whether the graph all-reduces its loss's label count (``defer_output_sums``): once
        self._counts_labels = (
            isinstance(local, fx.GraphModule)
            and sum(n.target is C.all_reduce_started for n in local.graph.nodes) == 1
        )
        # canonical FQN -> the permuted order a packed gate-up weight is kept in (ETP on its 2I
        # dim: autopar/lowerings/experts.py:PackedSplit); whole tensors cross in the model's order
        self._stored = dict(stored or {})
        self.local = local
        self._leaves = list(leaves)  # the parameters' plain leaves (local_leaves)
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
        self._hold_copies = False  # keep the half copies between forward calls (``step``)
        self._deferred: list = []  # the last call's outputs still being summed (defer_output_sums)
        # per input leaf: the mesh axis that splits its batch (dim 0), or None; the first such
        # axis on which the plan splits some op is the data-parallel one a loader feeds (data_rank,
        # data_world). On an axis that splits nothing an input split on the batch is gathered
        # whole before any op reads it: every rank there runs the whole batch (plan_axes.split_axes)
        self._batch_axes = list(batch_axes) or [None] * len(self._input_shapes)
        split = split_axes(plan)
        axis = next((a for a in self._batch_axes if a is not None and a in split), None)
        self._data = (mesh.get_local_rank(axis), mesh.size(axis)) if axis is not None else (0, 1)
        self._data_axis = axis
        # the inputs a call may give (each input's name, the whole batch or this rank's slice)
        self.feeding = Feeding(
            tuple(arg_names) or tuple(f"input {i}" for i in range(len(self._input_shapes))),
            tuple(self._input_shapes),
            tuple(self._batch_axes),
            self._data[1],
            self.micro_batches,
        )

    @property
    def code(self) -> str:
        """The generated rank-local code."""
        return self.local.code

    def _flat_inputs(self, args, kwargs, k: int = 1) -> tuple[list, int]:
        """The call's arguments flattened as the example inputs were (keyword arguments in their
        order; TypeError when they are structured otherwise), checked against the plan's shapes,
        and how many slices of the batch they are: 1 for the whole batch on every rank,
        ``data_world`` for this rank's slice (``data_rank``). ``k``: how many of the plan's
        batches they hold (``step``'s global batch of ``k`` micro-batches)."""
        kwargs = {key: kwargs[key] for key in self._kwarg_order if key in kwargs} | {
            key: v for key, v in kwargs.items() if key not in self._kwarg_order
        }
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise TypeError(
                f"the parallel module was planned for inputs structured as {self._in_spec}, got {spec}; "
                "call it with the same positional/keyword arguments as the example inputs"
            )
        sliced = self.feeding.slices(flat, k)
        self.feeding.check_shapes(flat, sliced, k)
        if not self._batch_checked:  # the first call: ranks fed alike hold the same batch
            named = list(zip(self.feeding.names, flat))
            if self.data_world > 1:
                agree(
                    "the ways ranks are fed", [("fed", "slices" if sliced > 1 else "the whole batch")],
                    "feed every rank the whole global batch, or every rank its own slice (pmodel.data_rank, "
                    "pmodel.data_world)",
                )  # fmt: skip
            if sliced == 1:
                agree(
                    "the batches", named,
                    "pass the same full global batch on every rank (the module slices each rank's part itself), or "
                    "each rank its own slice: rows data_rank::data_world of the batch (pmodel.data_rank, "
                    "pmodel.data_world), never another split",
                )  # fmt: skip
            else:
                agree(
                    "the batch slices of ranks with the same data_rank", named,
                    "ranks with the same pmodel.data_rank (they differ only on model-parallel axes) must be "
                    "fed the same slice of the batch",
                    key=self.data_rank,
                )  # fmt: skip
            self._batch_checked = True
        return flat, sliced

    @collective_section("forward")
    def forward(self, *args, **kwargs):
        flat, sliced = self._flat_inputs(args, kwargs)
        flat = [t.to(self._device) if isinstance(t, torch.Tensor) else t for t in flat]
        # the loss the last call returned, if never read: its sum completed long since (every
        # rank's backward ran after it), waited for here so that no collective stays unwaited
        C.wait_deferred(self._deferred)
        refresh_leaves(self._leaves, self.local_leaves)
        self.zero.leaves_active = self.local_leaves  # FSDP2's gathered parameters' (codegen/zero.py)
        # with ``loss_rides``, the returned loss rides in backward's buckets (``collectives.riding``,
        # set here directly); else a ride set by an outer module's forward is cleared
        sync = self.grad_sync if self.loss_rides and torch.is_grad_enabled() else None
        ride = C.RIDE.set((sync, self._read_check) if sync is not None else None)
        count = self._known_count(flat, sliced)
        known = C.KNOWN_SUM.set(count)
        scale = self._scale_after(flat) if count is None else None
        scaled = C.SCALE_AFTER.set(scale)
        try:
            with C.bound_mesh(self.mesh), self.zero.autocast(self._device.type):
                outs = self.local(*self.feeding.to_graph(flat, sliced))
        finally:
            C.SCALE_AFTER.reset(scaled)
            C.KNOWN_SUM.reset(known)
            C.RIDE.reset(ride)
            if not self._hold_copies:  # one cast per forward call, or per step (``step``)
                drop_copies(self.zero.half_params)
        self._deferred = [o for o in outs if isinstance(o, C.DeferredSum)]
        if scale is not None and any(
            isinstance(o, torch.Tensor) and o.requires_grad and not C.is_paired_mean(o) for o in outs
        ):  # backward may run through another output too (the logits): the loss's backward divides
            # by its count, and the next forwards all-reduce the count at their top, as before, so that
            # backward does not wait at its start for the pair summed at the forward's end
            scale[0] = None
            self.__dict__["_scale_blocked"] = True
        enter_backward(self, list(outs))
        return pytree.tree_unflatten(list(outs), self._out_spec)

    def _known_count(self, flat: list, sliced: int) -> torch.Tensor | None:
        """The whole batch's label count the graph's token-mean loss divides by, where it is known
        without the all-reduce the graph starts for it (``defer_output_sums``), so that none runs:
        ``step``'s (its micro-batch weights summed the counts over the ranks once for the step),
        or, where this rank was fed the whole batch, counted here from its labels by the weights'
        program (``codegen/loss_weights.py``); the same integer the all-reduce of the ranks' counts
        gives, on every rank. None: this rank holds only its slice of the labels."""
        if self._step_count is not None:
            return self._step_count
        if not self._counts_labels or sliced > 1:
            return None
        weights = self._loss_weights
        if weights is None or weights.counts is None:
            return None
        with torch.no_grad():
            return weights.counts(*flat)

    def _scale_after(self, flat: list) -> list | None:
        """``collectives.SCALE_AFTER`` for a forward whose token-mean loss's count is not known
        (``_known_count``): its backward then runs on the loss's sum, the gradient buckets divide
        the reduced gradients by the whole batch's count (summed with the loss, one all-reduce of
        ``[sum, count]``, rather than the count's own at the forward's top: one collective less a
        step, as Megatron-LM's ``calculate_per_token_loss``). Only where every gradient this
        backward makes is reduced in those buckets: a data-parallel plan's (ZeRO 0 and 1; FSDP2's
        ZeRO 2 and 3, pipelines and tensor-parallel reductions keep the count's all-reduce), no
        input requiring gradient; an output other than the loss requiring gradient clears it
        (``forward``), and keeps it off for the module's later forwards. None: the count is
        all-reduced at the forward's top, as before."""
        sync = self.grad_sync
        if sync is None or not self._counts_labels or not torch.is_grad_enabled():
            return None
        if self.__dict__.get("_scale_blocked"):  # its outputs other than the loss require gradient
            return None
        unsynced = self.__dict__.get("_unsynced")
        if unsynced is None:  # the parameters whose gradients no bucket reduces (looked up once)
            bucketed = {id(p) for p in sync.parameters}
            unsynced = self.__dict__["_unsynced"] = [p for p in self.parameters() if id(p) not in bucketed]
        if any(p.requires_grad for p in unsynced):
            return None
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
            return None
        return [sync]

    @property
    def _read_check(self) -> Callable[[], None] | None:
        """What reading the loss before backward runs first (``collectives.DeferredSum``): the loss
        rides in backward's first gradient bucket, so a read before backward sums it on its own,
        a collective every rank must make; with ``check_calls``, checked so (``all_entered``)."""
        if not (self.check_calls and self.issues_collectives):
            return None
        ranks = self._collective_mesh().mesh.flatten().tolist()
        return functools.partial(
            all_entered, "reading the loss before backward", ranks, READ_FIX, self.entry_timeout_s
        )

    @property
    def issues_collectives(self) -> bool:
        """Whether a step of this module runs collectives across ranks (the plan places a
        collective, or its trades or pipeline do): then ``forward``, ``step`` and a backward
        through the forward's outputs can be entered by every rank together (``check_calls``,
        ``agree.collective_section``)."""
        plan = self.plan
        if self.__dict__.get("_issues_collectives") is None:
            self.__dict__["_issues_collectives"] = bool(
                any(d.collectives for d in plan.decisions)
                or int(plan.trades.zero_stage) > 0
                or plan.pipeline.enabled
                or self.grad_sync is not None
            )
        return self.__dict__["_issues_collectives"]

    @property
    def micro_batches(self) -> int:
        """How many micro-batches ``step`` splits the global batch into (``plan.trades``)."""
        trades = getattr(self.plan, "trades", None)
        return trades.micro_batches if trades is not None else 1

    @collective_section("step")
    def step(self, *args, loss_fn: Callable[[Any], torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        """Forward and backward of one training step on the GLOBAL batch (the arguments ``forward``
        takes, with the full batch); returns the step's loss, detached. The optimizer step is the
        caller's.

        The batch runs as ``k = micro_batches`` micro-batches: every tensor argument split on dim 0
        into ``k`` equal parts, forward and backward on each in turn, the gradients accumulated in
        ``.grad`` and reduced across ranks once, in the last backward. The loss of a micro-batch is
        ``loss_fn(out)`` when given, else ``out.loss`` (Hugging Face style outputs), else ``out``
        when it is a scalar tensor. The graph's own loss (``loss_fn`` may return it as it is) is
        weighted as the global batch's (``codegen/loss_weights.py``): a token-mean cross-entropy
        by the labels each micro-batch counts (``ignore_index`` ones left out), a summed one by 1,
        any other by ``1/k``; the accumulated gradient and the returned loss are then the global
        batch's. A loss ``loss_fn`` computes itself is weighted ``1/k``: exact when it is a mean
        over equally many elements in every micro-batch. With ``k == 1``: one forward and one
        backward of the unscaled loss."""
        k = self.micro_batches
        if k > 1:
            batch, micro = batch_size((args, kwargs), 1), self._input_shapes[0][0]
            if batch not in (micro * k, micro * k // self.data_world):
                raise InputsError(
                    f"step takes the global batch, {micro * k} rows ({k} micro-batches of {micro}, the plan's), "
                    f"or this rank's slice of it; got {batch}; plans are specialized to the example inputs' shapes: "
                    "re-plan for this batch"
                )
            flat, sliced = self._flat_inputs(args, kwargs, k)  # checked (and compared across ranks) whole
            factors, counts = self._micro_batch_factors(flat, sliced, k)
            parts = split_batch((args, kwargs), k)
        else:
            parts, counts = [(args, kwargs)], None
        losses = []
        # mixed precision: the parameters' half copies cast once for the step's micro-batches
        # (codegen/local_params.py), as the pricing's parameter memory holds them through the step
        self._hold_copies = k > 1
        try:
            for i, (a, kw) in enumerate(parts):
                self._set_grad_sync(i == k - 1)
                # the micro-batch's label count, summed over the ranks already: its forward's
                # all-reduce of it would give the same (``_known_count``), so none runs
                self._step_count = counts[i] if counts is not None and self._counts_labels else None
                out = self(*a, **kw)
                loss = _loss_of(out, loss_fn)
                # the graph's own loss (a caller's loss_fn may return it as it is) times k c_i / sum c
                # (codegen/loss_weights.py); a loss the caller computes, as it is
                if k > 1 and factors[i] != 1.0 and any(loss is t for t in pytree.tree_leaves(out)):
                    loss = loss * factors[i]
                del out
                (loss / k if k > 1 else loss).backward()
                losses.append(loss.detach())
                del loss  # this micro-batch's graph is freed before the next forward
        finally:
            self._step_count = None
            self._set_grad_sync(True)
            self._hold_copies = False
            drop_copies(self.zero.half_params)
        if self.grad_sync is not None:
            self.grad_sync.finish()  # what a last backward that reached no bucketed parameter left
        return torch.stack(losses).mean() if k > 1 else losses[0]  # sum_i c_i L_i / sum c

    def _micro_batch_factors(
        self, flat: list, sliced: int, k: int
    ) -> tuple[list[float], torch.Tensor | None]:
        """Per micro-batch, the factor ``step`` multiplies the graph's own loss by before dividing
        by ``k`` (``codegen/loss_weights.py``): 1 each where the plain mean is the global batch's;
        and the labels each micro-batch's loss counts over the whole micro-batch (None: no count).
        ``flat``: the step's inputs (``_flat_inputs``); ``sliced`` > 1: this rank's slice, whose
        counts are summed over the data-parallel ranks (one all-reduce of ``k`` numbers)."""
        weights = self._loss_weights
        if weights is None:
            return [1.0] * k, None
        if weights.counts is None:
            return weights.factors(split_batch(list(flat), k)), None
        parts = split_batch(list(flat), k)
        reduce = None
        if sliced > 1 and self._data_axis is not None:
            group = self.mesh.get_group(self._data_axis)

            def reduce(counts: torch.Tensor) -> torch.Tensor:
                counts = counts.to(self._device)
                dist.all_reduce(counts, group=group)
                return counts.cpu()

        try:
            counts = weights.counted(parts, reduce)
        except RuntimeError as e:
            raise MicroBatchError(
                f"counting the labels each micro-batch's loss averages over failed on this rank's slice ({e}); "
                "feed step the whole global batch on every rank"
            ) from e
        return weights.weigh(counts), counts

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
        return self.zero.optimizer(self.parameters(), optimizer_class, order=self._read_order(), **kwargs)

    def _read_order(self) -> list[torch.Tensor]:
        """The state the generated forward reads, in the order it first reads it (the root's graph,
        each block's graph where the root calls it): ZeRO-1's buckets follow it, so that the
        gathers started after a step complete in the order the next forward needs them
        (``codegen/zero_one.py``). Empty where the module is no graph (a pipeline's chunks: their
        parameters come in chunk order already)."""
        out: list[torch.Tensor] = []

        def walk(gm: fx.GraphModule) -> None:
            for n in gm.graph.nodes:
                if n.op == "get_attr":
                    t = gm
                    for name in n.target.split("."):
                        t = getattr(t, name, None)
                    if isinstance(t, torch.Tensor):
                        out.append(t)
                elif n.op == "call_module":
                    sub = gm.get_submodule(n.target)
                    if isinstance(sub, fx.GraphModule):
                        walk(sub)

        if isinstance(self.local, fx.GraphModule):
            walk(self.local)
        return out

    def _settle(self) -> None:
        """Complete the ZeRO-1 all-gathers still in flight into the parameters (started by the
        optimizer step, waited for by the next forward: ``codegen/zero_one.py``) before anything
        outside the forward reads or writes them; under mixed precision, where they gathered half
        copies, gather the owners' exact fp32 shares into every rank's parameters
        (``ZeroOneOptimizer.exact``): a collective over the data axes, once after a step, so
        ``state_dict`` (and DCP's save and load through it), ``full_state_dict`` and the
        optimizer-state methods are collective then, and never read a rounded master."""
        wait_params(self.parameters())
        self.zero.exact()

    @torch.no_grad()
    def full_output(self, piece: torch.Tensor, index: int) -> torch.Tensor:
        """The whole output from this rank's ``piece`` of output leaf ``index`` (``output_specs``
        order); collective: every rank of the mesh calls it, each with its own piece, under any plan
        (a rank that calls it alone raises ``CollectiveCallError``, module docstring). For plans
        made with ``outputs=Outputs.LOCAL``."""
        spec = self.output_specs[index]
        if spec is None:
            raise ValueError(f"output {index} is not a tensor")
        self._all_entered(
            "full_output",
            "call it on every rank, each with its piece of the same output, and keep the whole where it is needed",
        )
        return C.gather_full(piece, spec, self.mesh)

    @torch.no_grad()
    def full_state_dict(self, rank0_only: bool = False, cpu: bool = False) -> dict[str, torch.Tensor]:
        """Full (unsharded) tensors under the original model's state-dict names; collective on
        every rank, one tensor gathered at a time. ``rank0_only``: only rank 0 keeps them (the
        others return an empty dict), for ``save_pretrained``-style exports; ``cpu``: kept on
        the host. Called on some ranks only (``if rank == 0: ...``), it raises
        ``CollectiveCallError`` on those, after ``entry_timeout_s`` (module docstring)."""
        self._settle()
        self._all_entered("full_state_dict", FULL_STATE_FIX)
        keep = not rank0_only or dist.get_rank() == 0
        full = {}
        for fqn, (attr, spec) in self._state_specs.items():
            t = self._model_order(fqn, full_tensor(getattr(self.local, attr).detach(), spec, self.mesh))
            if keep:
                full[fqn] = t.cpu() if cpu else t
        if not keep:
            return {}
        return {
            name: full[fqn] if fqn in full else self._extra_state[name] for name, fqn in self._aliases.items()
        }

    @torch.no_grad()
    def full_grads(self) -> dict[str, torch.Tensor]:
        """The whole gradient of every parameter that has one, under the model's state-dict name
        (a tied parameter's first); collective on every rank (module docstring). For checks and
        debugging."""
        self._all_entered("full_grads", "call it on every rank and keep the result where it is needed")
        out = {}
        for fqn, (attr, spec) in self._state_specs.items():
            p = getattr(self.local, attr)
            if isinstance(p, torch.nn.Parameter) and p.grad is not None:
                out[fqn] = self._model_order(fqn, full_tensor(p.grad, spec, self.mesh))
        return out

    def _model_order(self, fqn: str, whole: torch.Tensor) -> torch.Tensor:
        """``whole`` (state ``fqn`` gathered as the module keeps it) in the model's order."""
        split = self._stored.get(fqn)
        return whole if split is None else split.from_stored(whole)

    def _stored_order(self, state_dict) -> dict:
        """``state_dict`` (the model's names) with each whole packed gate-up weight the module keeps
        permuted put in that order. A ``DTensor`` of one is taken as this module's own state
        (``state_dict()``, the stored order) only in its placements: of other placements its order is
        unknown, an error."""
        if not self._stored:
            return state_dict
        out = dict(state_dict)
        for name, fqn in self._aliases.items():
            split, src = self._stored.get(fqn), state_dict.get(name)
            if split is None or src is None:
                continue
            if isinstance(src, DTensor):
                mine = getattr(self.local, self._state_specs[fqn][0])
                if src.placements != mine.placements or src.device_mesh != mine.device_mesh:
                    raise ValueError(
                        f"load_state_dict: {name} is kept permuted (its gate and up halves split by expert tensor "
                        "parallelism) and this DTensor has other placements: load a full_state_dict() (whole tensors) "
                        "or this module's own state_dict()"
                    )
                continue
            out[name] = split.to_stored(src)
        return out

    def _all_entered(self, call: str, fix: str) -> None:
        """``CollectiveCallError`` unless every rank of the module's mesh enters ``call``."""
        ranks = self._collective_mesh().mesh.flatten().tolist()
        all_entered(call, ranks, fix, self.entry_timeout_s)

    def _collective_mesh(self) -> DeviceMesh:
        """The mesh whose every rank the collective methods gather over (a pipeline's: all stages)."""
        return self.mesh

    # -- state under the model's own names, with the plan's placements (codegen/state.py) ----------

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        """Attribute name -> this rank's parameter or buffer (a ``DTensor``)."""
        return {attr: getattr(self.local, attr) for attr, _ in self._state_specs.values()}

    def _canonical_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(the model's state-dict name, this rank's parameter) of every parameter it holds."""
        attrs = {attr: fqn for fqn, (attr, _) in self._state_specs.items()}
        return [(attrs[n.rpartition(".")[2]], p) for n, p in self.named_parameters()]

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The state under the original model's state-dict names (tied names included), each this
        rank's tensor with the plan's placements (a ``DTensor``; never gathered): what
        ``torch.distributed.checkpoint.save`` / ``load`` take (``codegen/state.py``). Collective
        after a ZeRO-1 step under mixed precision (``_settle``: the exact fp32 masters gathered
        over the data axes, as DCP's save is collective anyway): call it on every rank."""
        self._settle()
        attrs = {fqn: attr for fqn, (attr, _) in self._state_specs.items()}
        out = S.model_state_dict(self._state_tensors(), self._aliases, attrs, self._extra_state, keep_vars)
        out = {prefix + k: v for k, v in out.items()}
        if destination is not None:
            destination.update(out)
            return destination
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a state dict under the original names: whole tensors (e.g. a single-device model's
        ``state_dict()``), or ``DTensor``s in any placements (``dcp.load`` into this module's own
        ``state_dict()`` reads in place, and nothing is left to copy)."""
        self._settle()
        attrs = {fqn: attr for fqn, (attr, _) in self._state_specs.items()}
        missing, unexpected = S.load_model_state_dict(
            self._state_tensors(), self._aliases, attrs, self._stored_order(state_dict), strict
        )
        return S.IncompatibleKeys(missing, unexpected)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer``'s state under the model's parameter names, each tensor the optimizer's own
        (sharded as it keeps it): save it with ``torch.distributed.checkpoint`` beside
        ``state_dict()``, load it back with ``load_optimizer_state_dict`` (``codegen/state.py``)."""
        self._settle()
        return S.optimizer_state_dict(optimizer, self._canonical_params())

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        """Put a state dict from ``optimizer_state_dict`` (of this plan or any other, e.g. after
        ``dcp.load`` into this module's own) into ``optimizer``."""
        self._settle()
        # a packed weight kept permuted: its moments are in that order only in this plan's placements
        S.load_optimizer_state_dict(
            optimizer, self._canonical_params(), state_dict, exact=frozenset(self._stored)
        )

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the whole model as ``torch.nn.utils.clip_grad_norm_`` clips the
        single-device model's: returns the total norm (a plain tensor, the same on every rank).
        ``torch.nn.utils.clip_grad_norm_(pmodel.parameters(), ...)`` gives the same where every
        parameter lives on one mesh; this one also covers pipeline stages (``codegen/state.py``)."""
        params = list(self.parameters())
        total = S.total_grad_norm(params, norm_type, self._pipeline_group(), self.zero.pieces)
        S.clip_grads(params, max_norm, total)
        return total

    def _pipeline_group(self):
        """The process group over pipeline stages (None: no stages)."""
        return None

    # -- the data a rank is fed ------------------------------------------------------------------

    @property
    def data_rank(self) -> int:
        """This rank's coordinate among the data-parallel ranks (the plan's batch-splitting axis;
        0 without one): a loader gives each rank rows ``data_rank::data_world`` of every input that
        carries the batch, or any split in that order (module docstring, "Feeding data")."""
        return self._data[0]

    @property
    def data_world(self) -> int:
        """How many data-parallel slices the global batch is cut into (1 without data parallelism)."""
        return self._data[1]


def defer_output_sums(gm: fx.GraphModule) -> fx.GraphModule:
    """Let the generated forward return without waiting for the all-reduces whose only use is to
    be returned (the loss of the whole batch, summed over the data-parallel ranks):

    * ``all_reduce(x)`` returned as it is (a mean loss: MSE) becomes
      ``collectives.all_reduce_deferred``, started where it was and waited for where the caller
      reads it; same values, same backward (identity);
    * ``mean_of_sum_and_count(all_reduce([sum, count]))`` (a token-mean cross-entropy, whose
      backward needs the whole batch's count) becomes ``collectives.mean_deferred``: the count,
      which the labels alone give, is counted and its all-reduce started at the top of the forward
      (the label ops it needs moved there, ``_hoist``), the sum's is waited for where the loss is
      read. Same values; the same backward (d loss / d sum = 1 / count). Where the whole batch's
      count is known without it (``ParallelModule._known_count``: a rank fed the whole batch,
      ``step``'s micro-batches), that all-reduce does not run (``collectives.KNOWN_SUM``). Where
      every gradient the loss reaches is reduced in buckets (``ParallelModule._scale_after``), it
      does not run either: backward runs on the sum (d loss / d sum = 1), the count is summed with
      the sum (one all-reduce of ``[sum, count]``, or it rides in the first bucket), and the
      reduced gradients are divided by it where backward ends (``GradSync.divide_after``,
      Megatron-LM's ``calculate_per_token_loss``). Elsewhere it stays at the top: backward needs it
      from its start, and merged with the sum's at the forward's end it would make backward wait
      for the ranks to meet again.

    Only the root graph's outputs: a value the graph reads further is waited for at once anyway."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    changed = False
    for n in pytree.tree_leaves(out.args[0]):
        if not isinstance(n, fx.Node) or n.op != "call_function" or set(n.users) != {out}:
            continue
        if n.target is C.all_reduce:
            n.target = C.all_reduce_deferred
            changed = True
        elif n.target is L.mean_of_sum_and_count:
            changed |= _defer_mean(gm.graph, n)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


# the ops that give a rank's [sum, count] of a token loss -> positions of (target, ignore_index)
_SUM_AND_COUNT = {L.loss_sum_and_count: (1, 2), L.fused_loss_sum_and_count: (2, 3)}


def _defer_mean(graph: fx.Graph, mean: fx.Node) -> bool:
    """``defer_output_sums``' second rewrite, where ``mean`` reads ``all_reduce([sum, count])``
    alone and the labels the count needs can move to the top of the forward."""
    reduced = mean.args[0]
    if not isinstance(reduced, fx.Node) or reduced.target is not C.all_reduce or set(reduced.users) != {mean}:
        return False
    pair, axis = reduced.args
    where = _SUM_AND_COUNT.get(getattr(pair, "target", None))
    if where is None:
        return False
    target, ignore = pair.args[where[0]], pair.args[where[1]]
    if not isinstance(target, fx.Node) or not _hoist(graph, target):
        return False
    with graph.inserting_after(target):
        count = graph.call_function(L.label_count, (target, ignore))
    with graph.inserting_after(count):
        started = graph.call_function(C.all_reduce_started, (count, axis))
    with graph.inserting_after(mean):
        deferred = graph.call_function(C.mean_deferred, (pair, started, axis, mean.args[1]))
    mean.replace_all_uses_with(deferred)
    graph.erase_node(mean)
    graph.erase_node(reduced)
    return True


def _hoist(graph: fx.Graph, node: fx.Node) -> bool:
    """Move ``node`` and what it is computed from to the top of the forward (after the inputs), in
    their order, where those are inputs and ops on inputs alone (the labels sliced, shifted, cast:
    nothing a parameter or the model computes); False, and nothing moved, otherwise."""
    chain = inputs_chain(node, lambda n: True)  # the lowered graph's placeholders are its inputs
    if chain is None:
        return False
    seen = set(chain)
    nodes = list(graph.nodes)
    last_input = max(i for i, n in enumerate(nodes) if n.op == "placeholder")
    anchor = next(n for n in nodes[last_input + 1 :] if n not in seen)
    for n in chain:
        anchor.prepend(n)
    return True


READ_FIX = (
    "the loss is summed across ranks in backward's first gradient bucket; a rank that reads it before backward "
    "sums it on its own, a collective: read it before backward on every rank or on none (after backward any rank "
    "may read it alone)"
)

FULL_STATE_FIX = FULL_STATE_FIX = (
    "call it on every rank; pass rank0_only=True to keep the tensors on rank 0 only"
)


def full_tensor(t: torch.Tensor, spec: Spec, mesh: DeviceMesh) -> torch.Tensor:
    """The whole tensor of a piece of the module's state (collective over ``mesh``): a ``DTensor``
    on the module's mesh (the plan's placements; FSDP2's shards over the data axis on top, ZeRO-2/3)
    gathered whole; one on FSDP2's own data mesh (torch without SPMD meshes) gathered to the plan's
    piece, then that piece; a plain tensor, the plan's piece under ``spec``."""
    if isinstance(t, DTensor):
        whole = t.full_tensor()
        return whole if t.device_mesh == mesh else C.gather_full(whole, spec, mesh)
    return C.gather_full(t, spec, mesh)


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
