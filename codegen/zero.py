"""The plan's trades run by the real engines: ZeRO 1-3, mixed precision and optimizer offload.

``codegen/build.py`` calls ``apply_trades`` once, on the lowered rank-local graph, before the
gradient buckets are made; the ``AppliedTrades`` it returns travels with the ``ParallelModule``.

Which engine does what, and why
-------------------------------

* **ZeRO-2 and ZeRO-3: FSDP2** (``torch.distributed.fsdp.fully_shard``) over the plan's data axis
  (``Trades.data_axes`` of more than one rank; where two split the batch, expert parallelism beside
  data parallelism, over both, flattened into one shard dimension by ``DataParallelMeshDims``: a
  parameter whole on both is sharded over all their ranks, an expert split on one of them is left
  out as on one expert axis). FSDP2 already does what ZeRO-2/3 need and nothing
  here should rewrite: it shards each parameter on dim 0 over the data axis, all-gathers before
  forward (a module pre-hook, so the generated graph's ``get_attr`` reads the gathered parameter),
  reduce-scatters gradients after backward, and overlaps both with compute. The module's
  parameters are ``DTensor``s on its mesh with the plan's placements (``codegen/build.py``); on
  torch >= 2.13 FSDP2 takes them as they are ("SPMD meshes": ``dp_mesh_dims`` names the data axis,
  on which they are ``Replicate``) and shards them into ``DTensor``s on the same mesh, so every
  parameter of the module stays on one mesh; on older torch it shards their local pieces over the
  data axis's 1-D submesh (``SPMD_FSDP``).
  ZeRO-3 is ``reshard_after_forward=True`` (parameters freed after forward, gathered again for
  backward) per repeated block: each ``block_<i>`` child of the graph module
  (``codegen/blocks.py:split_blocks``, where it ran) is its own group, the rest of the graph
  (embeddings, head, loss) the root's; ZeRO-2 is ``reshard_after_forward=False`` (parameters
  stay gathered from forward through backward, FSDP2's ZeRO-2). Between steps FSDP2 keeps only
  the shards in both stages.
* **ZeRO-1: ``codegen/zero_one.py:ZeroOneOptimizer``** on the data axes (each parameter over those
  it is whole on): each rank keeps the
  optimizer state of ``1/d`` of every parameter, steps it and all-gathers the parameters after;
  the gradient buckets of the parameters it cuts into shares are reduce-scattered into them
  (``codegen/grad_sync.py``; Megatron-LM's distributed optimizer), the others all-reduced whole
  as without ZeRO. Written here
  because torch's ``ZeroRedundancyOptimizer`` cannot take ``DTensor`` parameters and FSDP2
  cannot leave gradients whole (that module's docstring).
* **Mixed precision: ``torch.autocast``** around the generated graph (``ParallelModule.forward``;
  the traced aten graph carries no dtype asserts, ``passes/trace.py``): the parameters are fp32
  masters (a half-precision model's weights are upcast here), so gradients and optimizer state
  are fp32 too; with FSDP2 also ``MixedPrecisionPolicy(param_dtype=half, reduce_dtype=fp32)``:
  the gathered parameters are half, the gradient reduce-scatter fp32. Every parameter FSDP2 does
  not gather (ZeRO-0/1, pipeline stages, FSDP2's ignored ones) is read as a half copy cast once
  per forward call or step (``AppliedTrades.mark_half_reads``, ``codegen/local_params.py``), so
  every stage runs the same numerics: embeddings and norms read half weights and the residual
  stream is half; autocast stays for the ops that upcast (losses; CUDA's softmax, norms' sums).
  ZeRO-1 all-gathers the half copies of the updated shares (``codegen/zero_one.py``).
* **Offload: FSDP2's ``CPUOffloadPolicy``** (pinned host memory where CUDA is there): sharded
  parameters (the fp32 masters), their gradients and so the optimizer state live in host memory,
  and the optimizer's step runs there. Each all-gather first copies the group's shards onto the
  device (in the all-gather's stream, so a prefetched gather copies ahead too), each
  reduce-scatter copies the gradient shards back. What the device keeps is the ZeRO stage's,
  and each offload has its one stage (``Trades``): ``Offload.OPTIMIZER`` runs with ZeRO-2, the
  gathered parameters stay on the device from forward through backward (ZeRO-Offload's split);
  ``Offload.PARAMETERS`` runs with ZeRO-3, the device holds only the blocks in flight, and the
  prefetch is explicit (``_prefetch_blocks``): each block's forward gathers the next block
  (``set_modules_to_forward_prefetch``), each block's backward the one before it
  (``set_modules_to_backward_prefetch``), one block ahead, in the blocks' order, which is the
  order the generated graph calls them in (``codegen/blocks.py:split_blocks``). On CPU ranks the
  host is the device: the copies are CPU-to-CPU copies and the same code path runs (FSDP2 accepts
  the policy there; ``tests/test_offload_params.py`` trains under it on gloo). Offload needs
  FSDP2's sharded parameters: a ZeRO-1 optimizer over host copies would be a hand-written engine
  for the one case no library covers.

Gradients: which engine reduces which
-------------------------------------

The generated graph's gradients are partial *sums* per rank (the loss is the global mean,
computed inside the graph), so FSDP2 reduces with SUM (``set_gradient_divide_factor(1.0)``, and
SUM on the wire: ``set_force_sum_reduction_for_comms``). FSDP2 shards exactly the parameters whose
accumulated gradient is partial on the data axes and complete on every other axis: those whose
"f" ``passes/grad_sync.py:deferred_grad_axes`` defers on exactly the data axes (codegen emitted
no "f" for them, and ``bucketed`` drops them from the gradient buckets, so their gradient is
reduced once, by FSDP2). Every other parameter is passed to FSDP2 as ignored and stays whole and
plain: its gradient is reduced as without ZeRO (inline "f", or a bucket of ``GradSync``), and
summing it again over the data axes would count it ``d`` times (GPT-2's position table, read by
positions every rank computes alike, is one: its gradient is already whole on every rank).
Parameters that need no gradient are sharded, as is none that is not whole on the data axis.

State and accumulation
----------------------

``ParallelModule.full_state_dict`` gathers FSDP2's shards over the data axes (``full_tensor``)
before the plan's own pieces; under mixed precision it returns the fp32 masters.
Gradient accumulation over micro-batches (``ParallelModule.step``) leaves FSDP2's reduce-scatters
on: turned off, FSDP2 would accumulate *unsharded* gradients, every group's whole gradient live
through the micro-batches, which is what ZeRO 2 and 3 exist to avoid; on, each micro-batch's
gradient is reduce-scattered into the sharded one (a reduce-scatter per micro-batch, priced so
by ``passes/trades.py``). Only the GradSync buckets (parameters FSDP2 does not shard) wait for
the last micro-batch.

The user's loop
---------------

::

    pmodel = autopar.autoparallelize(model, cluster, inputs, plan=plan)
    opt = pmodel.optimizer(torch.optim.AdamW, lr=3e-4)   # the optimizer every stage needs
    for batch in data:
        loss = pmodel(**batch).loss          # forward under autocast where the plan says so
        loss.backward()                      # reduce-scatters (ZeRO-2/3) or all-reduces
        opt.step()                           # on the shards, on the host when offloaded
        opt.zero_grad()

``ParallelModule.optimizer`` is the way to build the optimizer: ZeRO-1 needs its
``ZeroOneOptimizer``; otherwise it is the plain optimizer over ``parameters()`` (``DTensor``s;
under FSDP2 on older torch, where some may not be, the plain ones in a param group of their own so
that the foreach kernels never mix the two). Under FP16 the user adds a loss scaler
(``torch.amp.GradScaler``) as in any fp16 loop.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

try:  # torch >= 2.13: FSDP2 over DTensor parameters on the full mesh ("SPMD meshes")
    from torch.distributed.fsdp import DataParallelMeshDims

    SPMD_FSDP = True
except ImportError:  # pragma: no cover - older torch: FSDP2 over plain local tensors
    DataParallelMeshDims = None
    SPMD_FSDP = False

from autopar.codegen.local_params import LEAF_ATTR, LocalLeaf, mark_half, refresh_leaves
from autopar.codegen.local_step import LocalStepOptimizer, all_replicated
from autopar.codegen.lower import mangle
from autopar.codegen.zero_one import ZeroOneOptimizer
from autopar.passes.trace import Role, TracedGraph
from autopar.trades import Offload, Precision, Trades, TradesError, ZeroStage

_BLOCK = re.compile(r"block_\d+")
HALF = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


@dataclass
class AppliedTrades:
    """What ``apply_trades`` set up, as the ``ParallelModule`` needs it at run time."""

    trades: Trades = field(default_factory=Trades)
    data_axes: tuple[int, ...] = ()  # the data axes of more than one rank that ZeRO shards over
    mesh: DeviceMesh | None = None  # the module's mesh (ZeRO-1's optimizer gathers on its data axis)
    fsdp_modules: list = field(default_factory=list)  # FSDP2 groups: blocks first, the root last
    sharded: frozenset[str] = frozenset()  # parameter placeholders FSDP2 shards and reduces
    # torch < 2.13: id(parameter) -> (the module's mesh, the ranks holding its piece) for the
    # parameters FSDP2 shards as plain pieces over the data axis's mesh (state.total_grad_norm)
    pieces: dict[int, tuple[DeviceMesh, int]] = field(default_factory=dict)
    # whether the FSDP2 groups' forwards read their gathered parameters through plain leaves
    # (``_gathered_leaves``); ``ParallelModule.forward`` sets it from ``local_leaves`` each call
    leaves_active: bool = True
    # the parameters FSDP2 was told to leave alone (whole on the data axis or needing no data
    # reduction): the module's own, read through leaves of their own (codegen/build.py)
    ignored: list = field(default_factory=list)
    # the parameters the forward reads as half copies under mixed precision (``mark_half_reads``)
    half_params: list = field(default_factory=list)
    # the ZeRO-1 optimizers ``optimizer`` made (held weakly), whose half gathers round the
    # parameters until ``exact``
    zero_one: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    @property
    def half(self) -> torch.dtype | None:
        """The autocast dtype under mixed precision, else None."""
        return HALF.get(self.trades.precision)

    def mark_half_reads(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Under mixed precision, mark the fp32 masters among ``params`` that the forward reads as
        they are (all but FSDP2's sharded ones, which FSDP2 gathers in the half type) to be read as
        half copies (``codegen/local_params.py``), so every ZeRO stage runs what FSDP2's
        ``MixedPrecisionPolicy`` runs; kept in ``half_params``, returned."""
        params = list(params)
        if self.fsdp_modules:
            mine = {id(p) for p in self.ignored}
            params = [p for p in params if id(p) in mine]
        self.half_params = mark_half(params, self.half)
        return self.half_params

    def exact(self) -> None:
        """The parameters exactly the fp32 masters on every rank (``ZeroOneOptimizer.exact``:
        collective over the data axes where a ZeRO-1 step gathered half copies; nothing
        otherwise). ``ParallelModule`` calls it before any state is read."""
        for opt in list(self.zero_one):
            opt.exact()

    def bucketed(self, deferred: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The deferred gradient reductions left to ``GradSync``: all but FSDP2's."""
        return {p: axes for p, axes in deferred.items() if p not in self.sharded}

    def autocast(self, device_type: str):
        """The context the generated graph runs in: autocast to the half type, or nothing."""
        if self.half is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.half)

    def optimizer(
        self,
        params: Iterable[torch.nn.Parameter],
        optimizer_class,
        order: Sequence[torch.Tensor] = (),
        **kwargs,
    ):
        """``optimizer_class`` over ``params`` as this stage needs it (module docstring); ``order``:
        the parameters in the order the forward reads them (ZeRO-1's gather buckets follow it)."""
        params = list(params)
        if self.trades.zero_stage is ZeroStage.OPTIMIZER and self.data_axes:
            # the gathers send the forward's half copies (codegen/zero_one.py); the module makes
            # every rank's masters exact before its state is read (``exact``)
            opt = ZeroOneOptimizer(
                params, optimizer_class, self.mesh, self.data_axes, order=order, half=self.half, **kwargs
            )
            self.zero_one.add(opt)
            return opt
        shards = [p for p in params if isinstance(p, DTensor)]
        plain = [p for p in params if not isinstance(p, DTensor)]
        kwargs = foreach_kwargs(optimizer_class, shards, kwargs)
        if self.trades.zero_stage < ZeroStage.GRADIENTS and all_replicated(params):
            # data parallel: every parameter whole, stepped on its local tensor (codegen/local_step.py)
            return LocalStepOptimizer(params, optimizer_class, **kwargs)
        if shards and plain:  # foreach kernels take DTensors or plain tensors, not both
            return optimizer_class([{"params": shards}, {"params": plain}], **kwargs)
        return optimizer_class(params, **kwargs)


# optimizers whose multi-tensor ("foreach") step computes what their per-tensor step computes, bit
# for bit, on DTensor parameters as on plain ones (tests/test_optimizer_foreach.py checks each); NAdam, RAdam and
# ASGD round differently, Rprop's foreach step has no DTensor sharding rule
FOREACH_EXACT = frozenset(
    {
        torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
        torch.optim.Adamax, torch.optim.Adadelta,
    }
)  # fmt: skip


def foreach_kwargs(optimizer_class, shards: list, kwargs: dict) -> dict:
    """``kwargs`` with ``foreach=True`` where the parameters include ``DTensor``s on one mesh, the
    class is one of ``FOREACH_EXACT`` and the caller chose neither ``foreach`` nor ``fused``: torch
    defaults to the per-tensor loop off CUDA and for ``DTensor``s, where each parameter's every
    update op is a ``DTensor`` dispatch of its own (tens of microseconds of host time each); the
    foreach step dispatches each op once for all of them, with the same result."""
    if optimizer_class not in FOREACH_EXACT or not shards or "foreach" in kwargs or kwargs.get("fused"):
        return kwargs
    if len({id(p.device_mesh) for p in shards}) > 1:  # one foreach op takes DTensors on one mesh
        return kwargs
    return {**kwargs, "foreach": True}


def data_axes_of(axes: tuple[int, ...], mesh: DeviceMesh) -> tuple[int, ...]:
    """The data axes ZeRO shards over, in mesh order, each once. Several (expert parallelism beside
    data parallelism, the batch split on both) are sharded over together: FSDP2 flattens them into
    one shard dimension, ZeRO-1 shards each parameter over those it is whole on. An axis that is not
    the mesh's raises ``TradesError``."""
    out = tuple(sorted(set(axes)))
    if not out or out[0] < 0 or out[-1] >= mesh.ndim:
        raise TradesError(f"ZeRO over data axes {list(axes)}: the mesh has axes 0..{mesh.ndim - 1}; re-plan")
    return out


def sharded_params(
    tg: TracedGraph, deferred: dict[str, tuple[int, ...]], data_axes: tuple[int, ...]
) -> frozenset[str]:
    """Parameter placeholders FSDP2 shards and reduces: those whose gradient is partial on exactly
    the data axes (module docstring), and those that need no gradient."""
    out = set()
    for p in tg.placeholders:
        if p.role is not Role.PARAM:
            continue
        val = tg.state[p.target]
        needs_grad = val.requires_grad and val.dtype.is_floating_point
        if not needs_grad or set(deferred.get(p.name, ())) == set(data_axes):
            out.add(p.name)
    return frozenset(out)


def apply_trades(
    trades: Trades | None,
    gm: fx.GraphModule,
    mesh: DeviceMesh,
    tg: TracedGraph,
    deferred: dict[str, tuple[int, ...]],
    load: Callable[[torch.nn.Module], None] | None = None,
) -> AppliedTrades:
    """Apply ``trades`` to the rank-local graph module ``gm`` (in place) on ``mesh``: upcast the
    parameters to fp32 masters under mixed precision, make the data group, and shard with FSDP2
    for ZeRO-2/3 (and offload). ``load(module)``: makes the state registered in ``module``
    real (``codegen/build.py``: the pieces of a meta-device model); under FSDP2 called group by
    group, just before each is sharded, so that a rank holds its shards plus one group's pieces.
    ``trades`` None: none taken."""
    trades = trades if trades is not None else Trades()
    applied = AppliedTrades(trades)
    load = load if load is not None else (lambda m: None)
    axes = tuple(a for a in trades.data_axes if mesh.size(a) > 1)
    if not axes and mesh.size() == 1 and trades.zero_stage >= ZeroStage.GRADIENTS:
        # one device (passes/trades.py:zero_axes): FSDP2 over it shards nothing, but offloads
        axes = trades.data_axes[:1]
    if trades.zero_stage and axes:
        applied.data_axes = data_axes_of(axes, mesh)
        applied.mesh = mesh
    if trades.zero_stage < ZeroStage.GRADIENTS or not axes:
        load(gm)
        _upcast(applied, gm)
        return applied
    _fully_shard(applied, gm, tg, deferred, load)
    return applied


def _upcast(applied: AppliedTrades, module: torch.nn.Module) -> None:
    """fp32 masters under mixed precision (the gradients and optimizer state follow)."""
    if applied.trades.precision.mixed:
        for p in module.parameters():
            if p.dtype.is_floating_point and p.dtype != torch.float32:
                # swapped, as nn.Module.float() does: ``p.data = ...`` on a DTensor parameter
                # changes its outer dtype and leaves its local tensor in the half type
                torch.utils.swap_tensors(
                    p, torch.nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
                )


def _fully_shard(applied: AppliedTrades, gm: fx.GraphModule, tg: TracedGraph, deferred, load) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    trades, mesh = applied.trades, applied.mesh
    axes = applied.data_axes
    names = tuple(mesh.mesh_dim_names[a] for a in axes)
    # on one device no gradient is partial on any axis: FSDP2 takes those left complete
    applied.sharded = sharded_params(tg, deferred, tuple(a for a in axes if mesh.size(a) > 1))
    keep = {
        mangle(p.target) for p in tg.placeholders if p.role is Role.PARAM and p.name not in applied.sharded
    }
    half = applied.half
    kwargs = dict(
        reshard_after_forward=trades.zero_stage is ZeroStage.PARAMETERS,
        mp_policy=MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
        if half is not None
        else MixedPrecisionPolicy(),
        offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        if trades.offload is not Offload.NONE
        else OffloadPolicy(),
    )
    if SPMD_FSDP:
        # the parameters are DTensors on the module's mesh, whole on the data axes: FSDP2 shards
        # them over them (several flattened into one shard dimension: expert parallelism beside
        # data parallelism) and keeps every parameter on that one mesh (clip_grad_norm_ needs one)
        kwargs.update(
            mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=names[0] if len(names) == 1 else names)
        )
    else:
        if len(axes) > 1:
            raise TradesError(
                f"ZeRO-{int(trades.zero_stage)} over data axes {list(axes)} needs FSDP2 over SPMD meshes "
                f"(torch >= 2.13, this is {torch.__version__}): re-plan with zero_stage<=1"
            )
        axis = axes[0]
        # torch without SPMD meshes (< 2.13): FSDP2 shards plain tensors over a 1-D data mesh, so
        # the parameters it manages are handed to it as their local pieces (their DTensors end
        # on that mesh; the others stay on the module's: ParallelModule.clip_grad_norm_)
        kwargs.update(mesh=mesh[mesh.mesh_dim_names[axis]])
        if mesh.ndim > 1:
            warnings.warn(
                f"torch {torch.__version__} (< 2.13): FSDP2 shards the parameters of ZeRO-{int(trades.zero_stage)} "
                "on the data axis's own mesh, the others stay on the module's: "
                "torch.nn.utils.clip_grad_norm_(pmodel.parameters(), ...) cannot combine their norms "
                "and returns a wrong one; use pmodel.clip_grad_norm_(max_norm), or torch >= 2.13",
                stacklevel=2,
            )
    ignored: set[torch.nn.Parameter] = set()
    pieces: dict[tuple[torch.nn.Module, str], int] = {}
    blocks = [m for name, m in gm.named_children() if _BLOCK.fullmatch(name)]
    for m in [*blocks, gm]:  # bottom-up, as FSDP2 wants; each group's state made just before
        load(m)
        _upcast(applied, m)
        for (owner, leaf), p in _param_owners(m, skip=applied.fsdp_modules).items():
            for a in axes:
                if (
                    isinstance(p, DTensor)
                    and mesh.size(a) == 1
                    and not isinstance(p.placements[a], Replicate)
                ):
                    # a shard over one device is the whole tensor (the ILP breaks ties between such
                    # placements either way): FSDP2 takes it, as whole, to offload it
                    p = _whole_on(p, a)
                    owner.register_parameter(leaf, p)
            if leaf in keep or (
                isinstance(p, DTensor) and not all(isinstance(p.placements[a], Replicate) for a in axes)
            ):
                ignored.add(p)  # FSDP2 shards over the data axes what is whole on all of them
            elif not SPMD_FSDP and isinstance(p, DTensor):
                owner.register_parameter(
                    leaf, torch.nn.Parameter(p._local_tensor, requires_grad=p.requires_grad)
                )
                copies = math.prod(
                    mesh.size(a)
                    for a, pl in enumerate(p.placements)
                    if a != axes[0] and isinstance(pl, Replicate)
                )
                pieces[(owner, leaf)] = copies
        fully_shard(m, ignored_params=set(ignored), **kwargs)
        if SPMD_FSDP:
            owners = [
                key for key, p in _param_owners(m, skip=applied.fsdp_modules).items() if p not in ignored
            ]
            m.register_forward_pre_hook(_gathered_leaves(applied, owners))
        # FSDP2 registered its sharded parameters in place of the pieces
        applied.pieces.update({id(getattr(o, leaf)): (mesh, c) for (o, leaf), c in pieces.items()})
        pieces.clear()
        m.set_gradient_divide_factor(1.0)  # the graph's gradients are partial sums: reduce by SUM
        m.set_force_sum_reduction_for_comms(True)
        applied.fsdp_modules.append(m)
    applied.ignored = list(ignored)
    if trades.offload is Offload.PARAMETERS:
        order = sorted((name for name, _ in gm.named_children() if _BLOCK.fullmatch(name)), key=_block_index)
        _prefetch_blocks([gm.get_submodule(name) for name in order])


def _gathered_leaves(applied: AppliedTrades, owners: list[tuple[torch.nn.Module, str]]):
    """A forward pre-hook of an FSDP2 group, run after FSDP2's own (which gathers the group's
    parameters and sets them on their modules): gives each gathered ``DTensor`` parameter a plain
    leaf sharing its storage (``codegen/local_params.py``), so the generated forward reads it with
    no ``to_local`` autograd node and backward builds no ``DTensor`` gradient through one, as a
    plain model under FSDP2 computes on plain gathered parameters. The leaf's gradient moves to the
    gathered parameter's ``.grad`` as backward accumulates it, where FSDP2's post-backward reads it
    (AccumulateGrad nodes run as soon as they are ready, before the group's post-backward).
    FSDP2 keeps one gathered parameter per parameter and re-gathers into its storage, so the leaf
    is made once and refreshed only where that storage changed."""

    def hook(module, args) -> None:
        leaves = []
        for owner, name in owners:
            p = owner._parameters[name]
            leaf = getattr(p, LEAF_ATTR, None)
            if leaf is None:
                if not isinstance(p, DTensor):
                    continue
                leaf = LocalLeaf(p)
                setattr(p, LEAF_ATTR, leaf)
            leaves.append(leaf)
        refresh_leaves(leaves, applied.leaves_active)

    return hook


def _block_index(name: str) -> int:
    return int(name.rsplit("_", 1)[1])


def _prefetch_blocks(blocks: list[torch.nn.Module]) -> None:
    """One block ahead (module docstring): block ``i``'s forward prefetches block ``i + 1``'s
    gather (and so its copy from the host), its backward block ``i - 1``'s. FSDP2 skips the
    forward prefetch while a recomputation reruns a forward in backward."""
    for i, m in enumerate(blocks):
        if i + 1 < len(blocks):
            m.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            m.set_modules_to_backward_prefetch([blocks[i - 1]])


def _whole_on(p: DTensor, axis: int) -> torch.nn.Parameter:
    """Parameter ``p`` (its local tensor shared) replicated on mesh axis ``axis`` of one device."""
    placements = [Replicate() if a == axis else pl for a, pl in enumerate(p.placements)]
    whole = DTensor.from_local(
        p._local_tensor, p.device_mesh, placements, run_check=False, shape=p.shape, stride=p.stride()
    )
    return torch.nn.Parameter(whole, requires_grad=p.requires_grad)


def _param_owners(gm: torch.nn.Module, skip=()) -> dict[tuple[torch.nn.Module, str], torch.nn.Parameter]:
    """Every parameter of ``gm`` by (the module that registers it, its attribute name), but those
    of the modules in ``skip`` (groups already sharded)."""
    skipped = {id(x) for s in skip for x in s.modules()}
    return {
        (m, leaf): p
        for m in gm.modules()
        if id(m) not in skipped
        for leaf, p in m.named_parameters(recurse=False)
    }
