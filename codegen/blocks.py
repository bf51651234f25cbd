"""Blocks of the rank-local graph: split into one submodule per repeated block, then recomputed.

**Spans.** ``passes/blocks.py:find_blocks`` names each block's traced ``call_function`` nodes.
Lowering (``codegen/lower.py``) emits, for each traced node in order, the collectives that
reshard its inputs, then its local op(s), and marks the node that computes the traced node's
value with ``meta["traced"]``; a traced ``getitem`` becomes a lowered ``getitem`` of the marked
node (unmarked). So every lowered node has an *origin*: the traced node it was emitted for.
``origins`` reads it off: a marked node's mark; a ``getitem`` of a node of origin ``t`` the traced
``getitem`` of ``t`` with the same index; any other node (a reshard, a ``coordinate``, a dtype
read) the origin of the next node that has one, since lowering emits it for that node; nodes after
the last one (the outputs' gathers) belong to no block. Origins rise monotonically through the
lowered graph, so a block's span (the lowered nodes whose origin is one of its traced nodes) is
contiguous; ``split_blocks`` checks it and raises otherwise. A reshard shared by uses in two
blocks (``lower.py``'s ``made``) lives in the first and is one of its outputs.

**The split** is built by hand, not with ``torch.fx.passes.split_module``: that one turns every
region, the embeddings and the head included, into a ``submod_k`` (the root's ``.code`` becomes
a list of calls), copies ``get_attr`` targets into whichever partition reads them (a parameter read
in two places would be registered twice) and names nothing after the blocks. Here the root keeps
its own nodes inline and calls ``self.block_<i>(...)`` where block ``i``'s span was; block ``i`` is
an ``fx.GraphModule`` taking the values its span reads from before it (in first-use order) and
returning those read after it (one value, or a tuple).

**Who owns a parameter.** A parameter or buffer (a ``get_attr`` target) read by exactly one block
is registered on that block's submodule only, so ``fully_shard(root.block_<i>)`` (ZeRO-3) finds
each of its parameters in one place. One read by the root, or by several blocks (tied embeddings,
a rotary table every layer reads), stays on the root and is passed to the blocks as an argument.
The objects are the ones ``lower`` registered (``GradSync`` holds them): nothing is copied.
``getattr(root, name)`` of a moved attribute still resolves (``BlockedGraphModule``,
``attr_owner``), for code that looks state up by its flat name (``ParallelModule.full_state_dict``).

**Recomputation** (``apply_recompute``) replaces each block's ``forward``, on the instance, by
``torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)``:
module hooks (FSDP2's, once a block is sharded) stay outside the checkpoint, as torchtitan's
``checkpoint_wrapper`` inside ``fully_shard`` has them. ``Recompute.FULL`` keeps only the block's
inputs. ``Recompute.SELECTIVE`` passes ``create_selective_checkpoint_contexts`` a policy that saves
the outputs of matmuls (aten ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``linear``, ``matmul``) and
of scaled-dot-product attention, and recomputes everything else (norms, activations, softmax,
reshapes, and the collectives between them): Megatron-LM's selective recomputation.
``Recompute.HALF_MATMULS`` recomputes every other matmul of a block as well, as torchtitan's "op"
SAC does: ``passes/blocks.py:alternate_matmuls`` names them (the pricing reads the same set), and
calls put in the block's graph (``_mark_matmuls``) tell the policy, while the block runs, whether
the matmuls coming are such a one's. The preserved RNG state makes recomputed dropout draw the masks the forward
drew.

**Why ``run`` binds the mesh.** The generated code's collectives read the mesh from
``collectives.bound_mesh``, which ``ParallelModule.forward`` sets for the forward only. A
checkpoint re-runs the block during backward, where nothing is bound, so ``run`` binds the
module's mesh itself (in the forward it nests inside the same binding, a no-op). Collectives inside
a recomputed span run again in backward, in the same order on every rank (the backward order is
the graph's).
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Collection, Sequence

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.codegen import collectives as C
from autopar.passes.blocks import Block, alternate_matmuls
from autopar.trades import Recompute

aten = torch.ops.aten


class BlockSplitError(RuntimeError):
    """The lowered graph cannot be split along the blocks (a span is not contiguous)."""


class BlockedGraphModule(fx.GraphModule):
    """The root of a split graph. ``attr_owner``: attribute name -> the block submodule that owns
    it; ``getattr(root, name)`` of such an attribute returns the block's."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            owner = self.__dict__.get("attr_owner", {}).get(name)
            if owner is None:
                raise
            return getattr(self.get_submodule(owner), name)


def block_name(block: Block) -> str:
    return f"block_{block.index}"


_COMPUTE = ("call_function", "call_method", "call_module")


def origins(gm: fx.GraphModule, traced: fx.Graph) -> dict[fx.Node, str | None]:
    """Each lowered computing node -> the traced node it was emitted for (module docstring);
    None for the nodes after the last traced one."""
    getitems = {
        (n.args[0].name, n.args[1]): n.name
        for n in traced.nodes
        if n.op == "call_function" and n.target is operator.getitem
    }
    own: dict[fx.Node, str | None] = {}
    pending: list[fx.Node] = []
    for n in gm.graph.nodes:
        if n.op not in _COMPUTE:
            continue
        origin = n.meta.get("traced")
        if origin is None and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            origin = getitems.get((own.get(n.args[0]), n.args[1]))
        if origin is None:
            pending.append(n)
            continue
        for p in pending:
            own[p] = origin
        pending.clear()
        own[n] = origin
    for p in pending:
        own[p] = None
    return own


def split_blocks(gm: fx.GraphModule, blocks: Sequence[Block], traced: fx.Graph) -> BlockedGraphModule:
    """``gm`` (``lower``'s rank-local module of the traced graph ``traced``) with each block's span
    moved into a submodule ``block_<i>`` that owns the state only it reads (module docstring).
    Computes exactly what ``gm`` computes; ``gm`` itself is left as it was."""
    own = origins(gm, traced)
    block_of_traced = {name: b for b in blocks for name in b.nodes}
    order = [n for n in gm.graph.nodes if n.op in _COMPUTE]
    region: dict[fx.Node, int | None] = {}  # computing node -> block index, None: the root
    for n in order:
        b = block_of_traced.get(own[n])
        region[n] = None if b is None else b.index
    spans: dict[int, list[fx.Node]] = {}
    for n in order:
        if region[n] is not None:
            spans.setdefault(region[n], []).append(n)
    pos = {n: i for i, n in enumerate(order)}
    for i, span in spans.items():
        if pos[span[-1]] - pos[span[0]] + 1 != len(span):
            raise BlockSplitError(
                f"block {i}: its lowered nodes {span[0].name}..{span[-1].name} are interleaved with "
                "others; the graph cannot be split along the blocks"
            )

    # who reads each piece of state: a target read by exactly one block moves into it
    readers: dict[str, set] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            readers.setdefault(n.target, set()).update(region.get(u) for u in n.users)
    moved = {t: next(iter(r)) for t, r in readers.items() if len(r) == 1 and None not in r}
    by_index = {b.index: b for b in blocks}

    root = torch.nn.Module()
    attr_owner: dict[str, str] = {}
    for t in readers:
        if t not in moved:
            _set_attr(root, t, operator.attrgetter(t)(gm))
    subs: dict[int, tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]] = {}
    for i, span in spans.items():
        sub, ins, outs = _block_module(gm, span, {t for t, j in moved.items() if j == i})
        name = block_name(by_index[i])
        root.add_module(name, sub)
        for t, j in moved.items():
            if j == i:
                attr_owner[t] = name
        subs[i] = (sub, ins, outs)

    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.target in moved:
            continue
        i = region.get(n)
        if n in env:  # a placeholder a block read first
            continue
        if i is None:
            env[n] = g.node_copy(n, env.__getitem__)
            continue
        if n is not spans[i][0]:
            continue
        _, ins, outs = subs[i]
        for x in ins:  # an input the graph declares after the block's first node (its slice is the block's)
            if x not in env and x.op == "placeholder":
                env[x] = g.node_copy(x, env.__getitem__)
        call = g.call_module(block_name(by_index[i]), tuple(env[x] for x in ins))
        if len(outs) == 1:
            env[outs[0]] = call
        else:
            for k, o in enumerate(outs):
                env[o] = g.create_node("call_function", operator.getitem, (call, k), name=o.name)
                env[o].meta = dict(o.meta)
    g.lint()
    out = BlockedGraphModule(root, g, class_name=type(gm).__name__)
    out.attr_owner = attr_owner
    return out


def _set_attr(module: torch.nn.Module, target: str, value) -> None:
    *path, leaf = target.split(".")
    for p in path:
        if not hasattr(module, p):
            module.add_module(p, torch.nn.Module())
        module = getattr(module, p)
    if isinstance(value, torch.nn.Parameter):
        module.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        module.register_buffer(leaf, value)
    else:
        setattr(module, leaf, value)


def _block_module(gm: fx.GraphModule, span: list[fx.Node], owned: set[str]):
    """(submodule computing ``span``, the nodes it reads from outside, the span nodes read after it)."""
    inside = set(span)
    ins: list[fx.Node] = []
    for n in span:
        for x in n.all_input_nodes:
            if x not in inside and x not in ins and not (x.op == "get_attr" and x.target in owned):
                ins.append(x)
    outs = [n for n in span if any(u not in inside for u in n.users)]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {x: g.placeholder(x.name) for x in ins}
    for x in ins:
        env[x].meta = dict(x.meta)

    def arg(x: fx.Node) -> fx.Node:
        if x not in env:  # a get_attr of state this block owns: read it where it is used
            env[x] = g.get_attr(x.target)
        return env[x]

    for n in span:
        env[n] = g.node_copy(n, arg)
    g.output(env[outs[0]] if len(outs) == 1 else tuple(env[o] for o in outs))  # () if none
    g.lint()
    holder = torch.nn.Module()
    for t in owned:
        _set_attr(holder, t, operator.attrgetter(t)(gm))
    return fx.GraphModule(holder, g, class_name="Block"), ins, outs


# ------------------------------------------------------------------------------------------------
# recomputation
# ------------------------------------------------------------------------------------------------

# outputs kept by selective recomputation: matmuls and attention (Korthikanti et al. 2022 keep
# the linear layers' outputs and recompute what lies between them; torchtitan's "op" SAC)
SAVED_OPS = frozenset(
    op
    for op in (
        aten.mm,
        aten.addmm,
        aten.bmm,
        aten.baddbmm,
        aten.linear,
        aten.matmul,
        aten.scaled_dot_product_attention,
        getattr(aten, "_scaled_dot_product_flash_attention", None),
        getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None),
        getattr(aten, "_scaled_dot_product_efficient_attention", None),
        getattr(aten, "_scaled_dot_product_cudnn_attention", None),
    )  # fmt: skip
    if op is not None
)


MATMUL_OPS = frozenset((aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.linear, aten.matmul))


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save the outputs of matmuls and attention, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# whether the matmuls the generated code runs next are ones ``Recompute.HALF_MATMULS`` recomputes:
# set by the calls ``_mark_matmuls`` puts in a block's graph, read by ``half_matmuls_policy``; per
# thread, as a CUDA backward (and so a recomputation) runs on autograd's device thread
_AGAIN = threading.local()


def recompute_matmuls(again: bool) -> None:
    """The matmuls that follow, up to the next call, are recomputed (``again``) or saved."""
    _AGAIN.on = again


def half_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """``selective_policy``, except that the matmuls of a traced matmul ``alternate_matmuls``
    names (every chunk of its collective matmul too) are recomputed."""
    packet = op.overloadpacket
    if packet in SAVED_OPS and not (packet in MATMUL_OPS and getattr(_AGAIN, "on", False)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _mark_matmuls(sub: fx.GraphModule, traced: fx.Graph, again: frozenset[str]) -> None:
    """Put ``recompute_matmuls`` calls in block ``sub``'s graph where the origin of its nodes
    (``origins``) goes from a matmul of ``again`` to any other node or back, one first: the
    policy then tells the matmuls a traced node was lowered to by the traced node, however many
    the lowering runs. In place."""
    own = origins(sub, traced)
    state = None
    for n in list(sub.graph.nodes):
        if n.op not in _COMPUTE:
            continue
        flag = own.get(n) in again
        if flag != state:
            with sub.graph.inserting_before(n):
                sub.graph.call_function(recompute_matmuls, (flag,))
            state = flag
    sub.recompile()


def apply_recompute(
    split_gm: fx.GraphModule,
    mode: Recompute,
    mesh: DeviceMesh,
    traced: fx.Graph | None = None,
    blocks: Sequence[Block] = (),
    only: Collection[int] | None = None,
) -> fx.GraphModule:
    """Run every ``block_<i>`` of ``split_gm`` (or those whose index ``i`` is in ``only``: the
    blocks ``Trades.recomputed`` names where the plan recomputes part of them, the rest keeping
    every activation) under activation checkpointing (module docstring);
    in place, returns ``split_gm``. ``Recompute.NONE`` leaves it as it is. The checkpointed forward
    is an instance attribute of each block: a ``copy.deepcopy`` of the module (which re-creates
    each GraphModule from its graph) runs without recomputation. ``Recompute.HALF_MATMULS`` needs
    the ``traced`` graph and its ``blocks`` (which matmuls it recomputes)."""
    mode = Recompute(mode)
    if mode is Recompute.NONE:
        return split_gm
    policy = {Recompute.SELECTIVE: selective_policy, Recompute.HALF_MATMULS: half_matmuls_policy}.get(mode)
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy) if policy else None
    again = frozenset()
    if mode is Recompute.HALF_MATMULS:
        if traced is None:
            raise ValueError("Recompute.HALF_MATMULS needs the traced graph and its blocks")
        target = {n.name: str(n.target) for n in traced.nodes}
        again = alternate_matmuls(list(blocks), lambda v: target.get(v, ""))
    for name, block in split_gm.named_children():
        if name.startswith("block_"):
            if only is not None and int(name.removeprefix("block_")) not in only:
                continue
            if again:
                _mark_matmuls(block, traced, again)
            # an instance attribute wins over the generated class-level forward, recompiled or not
            block.forward = _checkpointed(block, mesh, context_fn)
            block.recompute = mode
    return split_gm


def _checkpointed(block: torch.nn.Module, mesh: DeviceMesh, context_fn):
    def run(*args):
        with C.bound_mesh(mesh):  # recomputation runs in backward, where no mesh is bound
            return type(block).forward(block, *args)

    kwargs = {"context_fn": context_fn} if context_fn is not None else {}

    def forward(*args):
        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    return forward
