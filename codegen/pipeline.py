"""Pipeline stages of the rank-local graph, run by ``torch.distributed.pipelining``.

A pipelined plan (``plan.pipeline``, ``autopar/trades.py:Pipeline``) cuts the step into chunks at
repeated-block boundaries. The devices are ``stages`` copies of the plan's stage mesh, the pipeline
the outermost axis (``"pp"``): every rank lowers the whole graph for its stage mesh (``lower``,
as without a pipeline), then keeps only the chunks its pipeline rank runs (``c % stages == p``).

**The split** (``split_chunks``). ``codegen/blocks.py:origins`` maps each lowered node to the
traced node it was emitted for; a traced node in a block runs in that block's chunk, one before
the first block (embeddings) in chunk 0, one between two blocks (an encoder's final norm, a
decoder's embedding: ``passes/blocks.py:between_blocks``) in the chunk of the block before it, one
after the last (head, loss, the outputs' gathers) in the last. Values a node derives from the
model's inputs and buffers alone (position ids, masks, rotary tables: *input-derived*, no parameter
upstream) are not sent between stages: every chunk that reads one computes it again from the
inputs, in-place writes into it included. A chunk takes the model's inputs it reads
(``Chunk.inputs``) as keyword arguments: ``PipelineStage`` passes the ``step`` call's keyword
arguments, split into micro-batches, to every stage of a rank, and ``step`` passes only those its
chunks read (as a hand-split pipeline feeds its first stage the ids and its last the labels).
Every other value a later chunk reads crosses each boundary in between: chunk ``c`` takes the
values crossing into it as positional arguments (in graph order) and returns those crossing out
of it, passing through the ones it does not use; the last chunk returns the graph's outputs.

**Parameters** live in the chunks that read them. One read by chunks on different pipeline ranks
(tied input and output embeddings) is a copy on each: their gradients are summed across those
ranks after backward (``_tied``, a group per stage-mesh position), so the copies take the same
optimizer steps and stay equal, as Megatron-LM keeps its tied embeddings.

**Run.** Each chunk is a ``PipelineStage`` (stage index ``c`` of ``stages * virtual_stages``, the
``pp`` group), its forward binding the stage mesh (``collectives.bound_mesh``) and the plan's
autocast. ``step(**batch)`` calls the plan's schedule (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``) with the global batch as keyword arguments: the schedule splits it
into the plan's micro-batches, runs forwards and backwards in its order and sends activations and
their gradients between stages. The loss of a micro-batch is the model's (``out.loss``) or
``loss_fn(out)``, weighted as ``ParallelModule.step`` weighs it (``codegen/loss_weights.py``: by the
labels it counts, for the model's own token-mean loss; the weights travel as the schedule's
per-micro-batch ``target``); gradients are those of the weighted mean over micro-batches (divided
by ``k`` here, not by the schedule: a parameter two chunks of one rank share must be divided once). The chunks compute
on the parameters' plain leaves (``codegen/local_params.py``; not under zero bubble, whose split
backward finds the weights through the chunk's parameters): autograd sums the micro-batches'
gradients on each leaf, moved to the parameter's ``.grad`` once, after the schedule. Data-parallel
gradient all-reduces (``GradSync``) accumulate locally over the micro-batches and run once, after
the schedule. A ``.grad`` that holds values when ``step`` starts (not zeroed since the last step)
is set aside and added back at the end, so the division and the reductions see this step's
gradients alone. ``step`` returns the mean loss on every rank (broadcast from the last stage,
which does not wait for the others to receive it: the next step does).

Hand-written here (no library does it for an FX graph that is already rank-local): the cut of the
graph into chunk modules. ``torch.distributed.pipelining.pipeline`` splits a model by tracing it
again with ``torch.export`` at ``pipe_split`` markers; the graph here is the lowered one, with
this project's collectives in it, and the cut points are the plan's.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.codegen import collectives as C
from autopar.codegen.agree import collective_section
from autopar.codegen.blocks import _COMPUTE, _set_attr, origins
from autopar.codegen.local_params import drop_copies, refresh_leaves
from autopar.codegen.module import FULL_STATE_FIX, ParallelModule, _loss_of, full_tensor
from autopar.errors import AutoparError
from autopar.passes.blocks import Block, between_blocks
from autopar.passes.rules import storage_base, written_inputs
from autopar.trades import Pipeline, Schedule


class PipelineSplitError(AutoparError, RuntimeError):
    """The lowered graph cannot be cut into the plan's chunks."""


@dataclass
class Chunk:
    """One chunk of the split: its module (positional arguments: the values crossing into it;
    keyword arguments: the model's inputs by placeholder name), and which parameters it holds."""

    index: int
    module: fx.GraphModule
    params: dict[str, torch.nn.Parameter]  # get_attr target -> the parameter object
    state: dict[str, torch.Tensor]  # get_attr target -> every tensor it reads (buffers too)
    # the last chunk's graph outputs that are None (``Outputs.LOSS`` drops all but the loss): a
    # pipeline stage returns tensors only, so it leaves them out and the loss function puts them back
    absent: tuple[int, ...] = ()
    # the model's inputs (placeholder names) the chunk reads, its keyword arguments: the others are
    # neither split into micro-batches nor passed to it
    inputs: tuple[str, ...] = ()


def chunk_of_nodes(
    gm: fx.GraphModule, traced: fx.Graph, blocks: Sequence[Block], pipeline: Pipeline
) -> tuple[dict[fx.Node, int], set[fx.Node]]:
    """(each lowered computing node that is not input-derived -> its chunk, the input-derived
    nodes), module docstring."""
    last = pipeline.chunks - 1
    own = origins(gm, traced)
    block_of = {name: b.index for b in blocks for name in b.nodes}
    between = between_blocks(traced, blocks)
    tpos = {n.name: i for i, n in enumerate(traced.nodes)}
    first_block = min((tpos[n] for n in blocks[0].nodes), default=0) if blocks else 0
    derived: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            derived.add(n)
        elif n.op == "get_attr":
            if not isinstance(operator.attrgetter(n.target)(gm), torch.nn.Parameter):
                derived.add(n)
        elif n.op in _COMPUTE and all(x in derived for x in n.all_input_nodes):
            derived.add(n)
    chunk: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        if n.op not in _COMPUTE or n in derived:
            continue
        origin = own.get(n)
        if origin is None:
            chunk[n] = last
        elif origin in block_of:
            chunk[n] = pipeline.chunk_of_block(block_of[origin])
        elif origin in between:
            chunk[n] = pipeline.chunk_of_block(between[origin])
        else:
            chunk[n] = 0 if tpos.get(origin, 0) < first_block else last
    return chunk, derived


def split_chunks(
    gm: fx.GraphModule, traced: fx.Graph, blocks: Sequence[Block], pipeline: Pipeline, keep: set[int]
) -> list[Chunk]:
    """The chunks in ``keep`` of the lowered ``gm`` (module docstring), in index order."""
    chunk, derived = chunk_of_nodes(gm, traced, blocks, pipeline)
    n_chunks = pipeline.chunks
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]

    def where(n: fx.Node) -> int | None:
        return n_chunks - 1 if n is out_node else chunk.get(n)

    # the chunks that read each value (input-derived values and parameters are not sent)
    last_reader: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        c = where(n)
        if c is None:
            continue
        for x in n.all_input_nodes:
            if x in chunk:
                if chunk[x] > c:
                    raise PipelineSplitError(
                        f"{n.name} (chunk {c}) reads {x.name} of the later chunk {chunk[x]}: the graph's order "
                        "does not follow its blocks; re-plan without pipeline stages"
                    )
                last_reader[x] = max(last_reader.get(x, c), c)
    # the input-derived in-place writes, by the storage they write
    writers: dict[fx.Node, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n in derived and n.op == "call_function":
            for w in written_inputs(n):
                writers.setdefault(storage_base(w), []).append(n)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # crossing[c]: the values sent from chunk c to chunk c + 1, in graph order
    crossing = [
        sorted((x for x, r in last_reader.items() if chunk[x] <= c < r), key=order.__getitem__)
        for c in range(n_chunks - 1)
    ]
    out = []
    for c in sorted(keep):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        received = crossing[c - 1] if c > 0 else []
        for x in received:
            env[x] = g.placeholder(x.name)
            env[x].meta = dict(x.meta)
        for p in inputs:
            env[p] = g.placeholder(p.name)
            env[p].meta = dict(p.meta)
        mine = [n for n in gm.graph.nodes if chunk.get(n) == c]
        # the input-derived nodes this chunk reads, with what they read in turn, and the in-place
        # writes into any of their storages (T5's shift-right copies the labels into new zeros)
        need: set[fx.Node] = set()
        stack = [x for n in mine for x in n.all_input_nodes] + (
            list(out_node.all_input_nodes) if c == n_chunks - 1 else []
        )
        while stack:
            x = stack.pop()
            if x in derived and x not in need and x.op != "placeholder":
                need.add(x)
                stack.extend(x.all_input_nodes)
                stack.extend(writers.get(storage_base(x), ()))
        params: dict[str, torch.nn.Parameter] = {}
        state: dict[str, torch.Tensor] = {}
        holder = torch.nn.Module()
        for n in gm.graph.nodes:
            if n.op == "get_attr" and (n in need or any(chunk.get(u) == c for u in n.users)):
                value = operator.attrgetter(n.target)(gm)
                _set_attr(holder, n.target, value)
                state[n.target] = value
                if isinstance(value, torch.nn.Parameter):
                    params[n.target] = value
                env[n] = g.node_copy(n, env.__getitem__)
            elif n in need or chunk.get(n) == c:
                env[n] = g.node_copy(n, env.__getitem__)
        absent: tuple[int, ...] = ()
        if c == n_chunks - 1:
            outs = out_node.args[0]
            if isinstance(outs, (tuple, list)) and any(o is None for o in outs):
                absent = tuple(i for i, o in enumerate(outs) if o is None)
                g.output(tuple(env[o] for o in outs if o is not None))
            else:
                g.output(fx.map_arg(outs, env.__getitem__))
        else:
            # sent as laid out in memory: a view that crosses (an expanded position bias) is
            # copied, since the receiving stage's buffer is contiguous and gloo refuses strided ones
            g.output(tuple(g.call_method("contiguous", (env[x],)) for x in crossing[c]))
        g.eliminate_dead_code()
        read = []
        for p in inputs:  # an input the chunk does not read leaves its signature
            if env[p].users:
                read.append(p.name)
            else:
                g.erase_node(env[p])
        g.lint()
        module = fx.GraphModule(holder, g, class_name=f"Chunk{c}")
        out.append(Chunk(c, module, params, state, absent, tuple(read)))
    return out


class _ChunkRunner(torch.nn.Module):
    """A chunk as ``PipelineStage`` calls it: the stage mesh bound, under the plan's autocast, given
    the model's inputs it reads (of the keyword arguments of the rank's stages)."""

    def __init__(self, chunk: Chunk, mesh: DeviceMesh, autocast: Callable[[], Any]):
        super().__init__()
        self.chunk = chunk.module
        self._mesh = mesh
        self._autocast = autocast
        self._inputs = tuple((INPUT_PREFIX + name, name) for name in chunk.inputs)

    def forward(self, *received, **inputs):
        mine = {name: inputs[key] for key, name in self._inputs}
        with C.bound_mesh(self._mesh), self._autocast():
            out = self.chunk(*received, **mine)
        return out


# the model's inputs go through ``schedule.step`` as keyword arguments under this prefix: a model
# input named ``target`` or ``losses`` would otherwise be taken as the schedule's own argument
INPUT_PREFIX = "autopar_input_"


SCHEDULES = {
    Schedule.GPIPE: "ScheduleGPipe",
    Schedule.ONE_F_ONE_B: "Schedule1F1B",
    Schedule.INTERLEAVED_1F1B: "ScheduleInterleaved1F1B",
    Schedule.ZERO_BUBBLE: "ScheduleInterleavedZeroBubble",
}


def schedule_class(schedule: Schedule):
    """torch's class for ``schedule``; ``PipelineSplitError`` where the installed torch has none."""
    import torch.distributed.pipelining as pp

    cls = getattr(pp, SCHEDULES[schedule], None)
    if cls is None:
        raise PipelineSplitError(
            f"schedule {schedule.value} needs torch.distributed.pipelining.{SCHEDULES[schedule]}, which torch "
            f"{torch.__version__} does not have; re-plan with schedule='1f1b'"
        )
    return cls


class PipelinedModule(ParallelModule):
    """The rank-local module of a pipelined plan: this rank's chunks (``chunks``), run by the
    plan's schedule in ``step`` (module docstring). ``forward`` alone cannot run a pipeline: it
    raises, saying to call ``step``."""

    def __init__(
        self, *, chunks: list[Chunk], full_mesh: DeviceMesh, tied: list, input_names, spare: dict, **kwargs
    ):
        runners = torch.nn.ModuleList(
            _ChunkRunner(c, kwargs["mesh"], lambda: self.zero.autocast(self._device.type)) for c in chunks
        )
        super().__init__(local=runners, **kwargs)
        self.chunks = runners
        self.full_mesh = full_mesh
        self._chunks = chunks
        self._tied = tied  # [(attribute target, group)]: parameters copied on several pipeline ranks
        # the model's inputs (placeholder names, in order) and those this rank's chunks read
        self._input_names = list(input_names)
        self._read_inputs = {name for c in chunks for name in c.inputs}
        # state no chunk reads on a rank it is not stored on (buffers, unused parameters): each
        # rank's own copy, for ``full_state_dict``
        self._spare = spare
        pipe: Pipeline = self.plan.pipeline
        self.pipe_rank = full_mesh.get_local_rank("pp")
        self.pp_group = full_mesh.get_group("pp")
        from torch.distributed.pipelining import PipelineStage

        self.stages = [
            PipelineStage(runner, c.index, pipe.chunks, self._device, group=self.pp_group)
            for runner, c in zip(self.chunks, chunks)
        ]
        cls = schedule_class(pipe.schedule)
        k = self.micro_batches
        self._step_loss_fn: Callable[[Any], torch.Tensor] | None = None  # ``step``'s, while it runs
        self._loss_at: int | None = None  # which of the last stage's outputs is the model's own loss
        self._loss_sent: tuple[torch.Tensor, Any] | None = None  # the last step's loss broadcast, unwaited
        stage_arg = self.stages if pipe.schedule.multi_chunk else self.stages[0]
        self.schedule = cls(stage_arg, n_microbatches=k, loss_fn=self._loss, scale_grads=False)
        # the schedule's ``target``, indexed per micro-batch on the last stage: each micro-batch's
        # loss factor (``step``), given only where this rank runs the last chunk
        self._target = (
            torch.ones(k, dtype=torch.float64) if any(c.index == pipe.chunks - 1 for c in chunks) else None
        )

    @property
    def code(self) -> str:
        """The generated code of this rank's chunks."""
        return "\n".join(f"# chunk {c.index}\n{r.chunk.code}" for c, r in zip(self._chunks, self.chunks))

    def _pipeline_group(self):
        return self.pp_group

    def _collective_mesh(self) -> DeviceMesh:
        return self.full_mesh

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        held = dict(self._spare)
        for c in self._chunks:
            held.update(c.state)
        return held

    def parameters(self, recurse: bool = True):
        seen = set()
        for params in (c.params for c in self._chunks):
            for p in params.values():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        seen = set()
        for params in (c.params for c in self._chunks):
            for name, p in params.items():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield prefix + name, p

    def _loss(self, out, target):
        """The micro-batch's loss as the schedule backpropagates it: the graph's own (returned as it is
        by a caller's ``loss_fn`` too) times its factor, ``target`` (this micro-batch's entry of
        ``step``'s factors); a loss the caller's ``loss_fn`` computes, as it is."""
        loss, own = self._micro_loss(out)
        factor = float(target.reshape(-1)[0]) if own else 1.0
        return loss if factor == 1.0 else loss * factor

    def _micro_loss(self, out) -> tuple[torch.Tensor, bool]:
        """(The micro-batch's loss, whether it is one of the graph's outputs as they are.)"""
        sent = list(out) if isinstance(out, (tuple, list)) else [out]
        if self._step_loss_fn is None and self._loss_at is not None:
            return sent[self._loss_at], True
        outs = list(sent)
        for i in self._chunks[-1].absent:  # the last stage's rank holds the last chunk
            outs.insert(i, None)
        loss = _loss_of(pytree.tree_unflatten(outs, self._out_spec), self._step_loss_fn)
        if self._step_loss_fn is None:
            # the model's own loss (``out.loss``, or the output itself): the same one of the stage's
            # outputs at every call, as the plan fixes their structure, so later micro-batches take
            # it from there without building the model's output (a Hugging Face ModelOutput) again
            self._loss_at = next((i for i, t in enumerate(sent) if t is loss), None)
        return loss, any(t is loss for t in sent)

    def forward(self, *args, **kwargs):
        raise TypeError(
            "a pipelined module runs its stages only under its schedule: call pmodel.step(...) with the global "
            "batch (it returns the loss); forward alone has nothing to return on most ranks"
        )

    @collective_section("step")
    def step(self, *args, loss_fn: Callable[[Any], torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        """Forward and backward of one step on the GLOBAL batch through the pipeline (module
        docstring); returns the mean loss over the micro-batches on every rank."""
        k = self.micro_batches
        if self._loss_sent is not None:  # the last step's loss, sent from this rank
            self._loss_sent[1].wait()
            self._loss_sent = None
        flat, sliced = self._flat_inputs(args, kwargs, k)  # of the global batch: k micro-batches
        if self._loss_weights is not None:
            # each micro-batch's loss factor, read by ``_loss`` from the schedule's per-micro-batch
            # ``target`` (codegen/loss_weights.py; counted on every rank, the slices' summed over
            # the data axis: the same collectives on every pipeline rank; without weights it stays 1)
            factors, _ = self._micro_batch_factors(flat, sliced, k)
            if self._target is not None:
                self._target = torch.tensor(factors, dtype=torch.float64)
        flat = [t.to(self._device) if isinstance(t, torch.Tensor) else t for t in flat]
        with C.bound_mesh(self.mesh):
            flat = self.feeding.to_graph(flat, sliced, k)
        named = {
            INPUT_PREFIX + name: t for name, t in zip(self._input_names, flat) if name in self._read_inputs
        }
        refresh_leaves(self._leaves, self.local_leaves)
        self._step_loss_fn = loss_fn
        losses: list[torch.Tensor] = []
        if self.grad_sync is not None:
            self.grad_sync.set_requires_gradient_sync(False)
        # gradients ``.grad`` holds already (not zeroed since an earlier step) are set aside, and
        # this step's added to them at its end: the division by k, the reductions of the data-parallel
        # and tied parameters are then of this step's gradients alone, as the unpipelined step's
        kept = {}
        for p in self.parameters():
            if p.grad is not None:
                kept[id(p)], p.grad = (p, p.grad), None
        # the micro-batches' gradients summed on the leaves by autograd, moved to ``.grad`` once
        # (``LocalLeaf.hold``)
        for leaf in self._leaves:
            leaf.hold = leaf.active
        try:
            self.schedule.step(target=self._target, losses=losses, return_outputs=False, **named)
        finally:
            self._step_loss_fn = None
            drop_copies(self.zero.half_params)  # cast once a step, read by every micro-batch
            for leaf in self._leaves:
                leaf.release()
            if self.grad_sync is not None:
                self.grad_sync.set_requires_gradient_sync(True)
        if k > 1:
            with torch.no_grad():
                for p in self.parameters():
                    g = p.grad
                    if g is not None:
                        _plain(g).div_(k)
        if self.grad_sync is not None:
            self.grad_sync.finish()  # the data-parallel reductions, once for the whole step
        for target, group in self._tied:
            p = self._param_by_target(target)
            if p is not None and p.grad is not None:
                dist.all_reduce(p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad, group=group)
        with torch.no_grad():
            for p, g in kept.values():
                if p.grad is None:
                    p.grad = g
                elif _plain(p.grad).shape == _plain(g).shape:
                    _plain(p.grad).add_(_plain(g))
                else:  # placed otherwise (one of them ZeRO-1's reduce-scattered shares): DTensor adds
                    p.grad = p.grad + g
        last = self.plan.pipeline.rank_of_chunk(self.plan.pipeline.chunks - 1)
        loss = (
            torch.stack([x.detach().float() for x in losses]).mean()
            if losses
            else torch.zeros((), device=self._device)
        )
        if self.pipe_rank != last:
            dist.broadcast(loss, group=self.pp_group, group_src=last)
            return loss
        # the rank with the loss sends it without waiting for the others to take it (they finish
        # their last backwards after it): its optimizer step overlaps theirs, as in a hand-written
        # loop that broadcasts after the optimizer. A copy is sent, so the caller may modify the
        # loss; the send is waited for at the next step (a group runs its collectives in order)
        sent = loss.clone()
        self._loss_sent = (sent, dist.broadcast(sent, group=self.pp_group, group_src=last, async_op=True))
        return loss

    def _param_by_target(self, target: str) -> torch.nn.Parameter | None:
        for params in (c.params for c in self._chunks):
            if target in params:
                return params[target]
        return None

    @torch.no_grad()
    def full_state_dict(self, rank0_only: bool = False, cpu: bool = False) -> dict[str, torch.Tensor]:
        """Full tensors under the original model's state-dict names on every rank (``rank0_only``:
        rank 0 alone, the others get an empty dict; ``cpu``: on the host); collective over every
        rank: each tensor is gathered on the stage mesh of the lowest pipeline rank that holds it
        and broadcast over the pipeline. Called on some ranks only, it raises
        ``CollectiveCallError`` on those (``codegen/module.py``'s docstring)."""
        self._all_entered("full_state_dict", FULL_STATE_FIX)
        self._settle()  # ZeRO-1's gathers still in flight since the step (codegen/zero_one.py)
        held = {}
        for c in self._chunks:
            for name, t in c.state.items():
                held.setdefault(name, t)
        owners = torch.zeros(len(self._state_specs), dtype=torch.int64)
        for i, (_fqn, (attr, _spec)) in enumerate(self._state_specs.items()):
            owners[i] = self.pipe_rank if attr in held else self.plan.pipeline.stages
        dist.all_reduce(owners, op=dist.ReduceOp.MIN, group=self.pp_group)
        full = {}
        for i, (fqn, (attr, spec)) in enumerate(self._state_specs.items()):
            owner = int(owners[i])
            if owner == self.plan.pipeline.stages:  # held by no chunk: every rank has its copy
                full[fqn] = self._model_order(fqn, full_tensor(self._spare[attr].detach(), spec, self.mesh))
                continue
            mine = owner == self.pipe_rank
            t = full_tensor(held[attr].detach(), spec, self.mesh) if mine else None
            full[fqn] = self._model_order(fqn, _broadcast_tensor(t, owner, self.pp_group, self._device))
        if rank0_only and dist.get_rank() != 0:
            return {}
        out = {}
        for name, fqn in self._aliases.items():
            t = full[fqn] if fqn in full else self._extra_state[name]
            out[name] = t.cpu() if cpu else t
        return out


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A gradient's local values (a ``DTensor``'s local tensor: in-place arithmetic on it runs no
    ``DTensor`` dispatch)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _broadcast_tensor(t: torch.Tensor | None, src: int, group, device) -> torch.Tensor:
    """``t`` from pipeline rank ``src`` to every rank of ``group`` (shape and dtype sent first)."""
    obj = [(tuple(t.shape), t.dtype) if t is not None else None]
    dist.broadcast_object_list(obj, group=group, group_src=src)
    shape, dtype = obj[0]
    buf = t.contiguous() if t is not None else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(buf, group=group, group_src=src)
    return buf
