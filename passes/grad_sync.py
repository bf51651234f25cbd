"""Which parameter gradients are synchronized after backward accumulates them (DDP-style), not inline.

Under data parallelism a replicated weight used by a batch-split op gets Megatron's "f" on its
input edge: identity forward, all-reduce of the gradient backward (``passes/use_price.py:f_axes``).
Issued inline, that all-reduce blocks backward until it completes. Because it is linear and every
rank applies the same local ops, it commutes with summing the parameter's uses: when *every*
gradient-carrying use of a parameter needs the pure "f" on the same mesh axes ``D``,

    sum_c AR_D(g_c) = AR_D(sum_c g_c),

so codegen drops the per-use "f" and all-reduces the accumulated gradient once, asynchronously,
in a bucket with the other gradients completed about then (``grad_buckets``, as
DistributedDataParallel does; ``codegen/grad_sync.py``); backward compute then runs while the
reduction is in flight. The cost model prices each bucket and the overlap on a timeline
(``price_grad_sync``, ``cost_model/overlap.py``).

A pure "f" on axis ``a`` is one where the stored placement already equals the use's (Replicate).
Where the stored piece is a shard, the "f" fuses into the all-gather's backward reduce-scatter
(``codegen/lower.py:emit_reshard``) and stays inline; so do parameters whose uses disagree on ``D``.

Under ZeRO-1 a bucket whose members the optimizer cuts into shares (``scatter_axes``: a
parameter whole on those data axes, cut on a dim DTensor can say, ``share_cut_of``, as
``codegen/zero_one.py`` cuts it) is **reduce-scattered** instead: each rank receives only the sum
of its shares, the only part its optimizer steps (Megatron-LM's distributed optimizer reduce-
scatters its gradient buffer the same way). A reduce-scatter moves half an all-reduce's bytes.

The same linearity lets uses of an activation share a reshard (``reshard_key``, ``plan_uses``):
uses that need the tensor in the same placement with the same "f" take one copy, made at the
first, and backward reduces the sum of their gradients once. The cost tables price every use on
its own (the ILP pays a shared reshard once where both ends of its edges are variables,
``passes/solver.py``); ``GradSyncCost.shared_s`` takes the duplicates back out of the plan's step
time, and the timeline leaves them out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.cost_model.comm import CommModel
from autopar.cost_model.compute import BACKWARD_FACTOR
from autopar.cost_model.overlap import hidden_seconds
from autopar.lowerings.matmul_nd import is_grid
from autopar.passes.costs import resolve_source
from autopar.passes.rules import tensor_inputs, writes_inputs
from autopar.passes.strategies import Strategy
from autopar.passes.trace import Role, TracedGraph
from autopar.passes.use_price import (
    BUCKET_BYTES,
    bucket_fixed_s,
    f_axes,
    flatten_s,
    overlap_price,
    trainable_bytes,
    use_price,
)
from autopar.placement import (
    Outputs,
    Spec,
    is_replicate,
    is_shard,
    local_shape,
    output_placement,
    volume_factor,
)
from autopar.reshard import Collective

# ZeRO-1's parameter all-gathers (``codegen/zero_one.py``): the bytes one gathers (the whole
# parameters of a bucket, every rank's shares), and how many run at once between a step and the
# forward reading them
ZERO_ONE_BUCKET_BYTES = 25 * 2**20
ZERO_ONE_IN_FLIGHT = 2


def pure_f_axes(stored, s: Strategy, k: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Axes of input ``k`` of a use under ``s`` where the "f" runs alone (not fused into a gather)."""
    return tuple(a for a in f_axes(s, k) if mesh_shape[a] > 1 and stored[a] == s.ins[k][a])


def inline_f_axes(s: Strategy, k: int, deferred: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The "f" axes of input ``k`` under ``s`` that run inline: all but the ``deferred`` ones of
    the parameter feeding it (codegen emits these; the cost model prices these)."""
    return tuple(a for a in f_axes(s, k) if a not in deferred)


def emitted_f_axes(s: Strategy, k: int, inp: fx.Node, deferred: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The "f" axes codegen emits on input ``k`` (the tensor ``inp``) of a use under ``s``: the
    inline ones, and none on a tensor that carries no gradient (integer masks, indices)."""
    return inline_f_axes(s, k, deferred) if inp.meta["val"].dtype.is_floating_point else ()


def reshard_key(inp: fx.Node, stored, need, fops: tuple[int, ...], user: fx.Node) -> tuple | None:
    """Uses of one tensor that need the same reshard share it: codegen emits it once, at the first
    such use in graph order, and the cost model prices it once (Megatron's one "f" on the input of
    q, k and v). Under "f" the shared copy's gradient is the sum of the uses' gradients, reduced
    once; all-reduce, reduce-scatter and slices are linear, so that equals the sum of the uses'
    reduced gradients. The key, or None where the use runs its own: nothing to share, or ``user``
    writes to its inputs."""
    if tuple(stored) == tuple(need) and not fops:
        return None
    if writes_inputs(user):
        return None
    return (inp.name, tuple(stored), tuple(need), tuple(fops))


@dataclass(frozen=True)
class Use:
    """One tensor input of one op (or one graph output) in a plan, as codegen reshards it."""

    user: fx.Node  # the op, or the graph's output node
    k: int  # input index (the output's: position among its tensor inputs)
    inp: fx.Node  # the tensor taken
    src: str  # its producer (a getitem resolved)
    need: Spec  # the placement the use takes it in (a graph output: its ``Outputs`` placement)
    fops: tuple[int, ...]  # the "f" axes emitted on it
    runs: bool  # False: it takes the reshard an earlier use with the same key made


def plan_uses(
    tg: TracedGraph, choice: dict[str, Strategy], deferred: dict, outputs: Outputs = Outputs.FULL
) -> Iterator[Use]:
    """Every use whose input has a producer in ``choice``, in graph order (the graph's outputs
    taken in their ``outputs`` placement)."""
    seen: set[tuple] = set()
    deferred = deferred_sources(tg, choice, deferred)

    def use(node, k, inp, src, need, fops):
        key = reshard_key(inp, choice[src].out, need, fops, node)
        u = Use(node, k, inp, src, need, fops, key is None or key not in seen)
        if key is not None:
            seen.add(key)
        return u

    for node, ins in _walk(tg).inputs:
        if node.op == "output":
            for k, inp, src, _ in ins:
                if src in choice:
                    yield use(node, k, inp, src, output_placement(choice[src].out, outputs), ())
            continue
        if node.name not in choice:
            continue
        s = choice[node.name]
        for k, inp, src, floating in ins:
            if src in choice:
                # the "f" axes codegen emits (``emitted_f_axes``): none on a tensor without a gradient
                fops = inline_f_axes(s, k, deferred.get(src, ())) if floating else ()
                yield use(node, k, inp, src, s.ins[k], fops)


@dataclass(frozen=True)
class _Walk:
    """What the gradient sync reads of a graph's structure alone, whatever the plan: each op's
    (not a getitem's) and the output's tensor inputs as ``(k, input, its producer's name, whether
    it is floating)``, in graph order, and the nodes that carry a gradient (``_carries_grad``)."""

    inputs: tuple[tuple[fx.Node, tuple[tuple[int, fx.Node, str, bool], ...]], ...]
    grads: frozenset[str]


def _walk_of(tg: TracedGraph) -> _Walk:
    inputs = []
    for node in tg.graph.nodes:
        if node.op == "output":
            tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
            ins = tuple((k, inp, resolve_source(inp).name, False) for k, inp in enumerate(tensors))
        elif node.op == "call_function" and node.target is not operator.getitem:
            ins = tuple(
                (k, inp, resolve_source(inp).name, _floating(inp))
                for k, inp in enumerate(tensor_inputs(node))
            )
        else:
            continue
        inputs.append((node, ins))
    return _Walk(tuple(inputs), frozenset(_carries_grad(tg)))


def _floating(inp: fx.Node) -> bool:
    dtype = getattr(inp.meta.get("val"), "dtype", None)
    return dtype is not None and dtype.is_floating_point


# the graphs whose walks are kept (``walked_once``), and their walks
_WALKED: list[tuple[TracedGraph, _Walk]] = []


def _kept_walk(tg: TracedGraph) -> _Walk | None:
    for g, w in _WALKED:
        if g is tg:
            return w
    return None


def _walk(tg: TracedGraph) -> _Walk:
    """``_walk_of(tg)``: kept inside ``walked_once(tg)``, else walked anew."""
    kept = _kept_walk(tg)
    return kept if kept is not None else _walk_of(tg)


def _grads(tg: TracedGraph) -> set[str] | frozenset[str]:
    """``_carries_grad(tg)``, kept inside ``walked_once(tg)``."""
    kept = _kept_walk(tg)
    return kept.grads if kept is not None else _carries_grad(tg)


@contextlib.contextmanager
def walked_once(tg: TracedGraph):
    """Inside: ``tg``'s structure (``_Walk``) walked once and read by every plan's gradient sync
    (a search prices the solutions of every rung that fits: DeepSeek-V3 on 512 H100, 46 of them
    over a graph of 8,500 nodes). The graph must not change inside (the search's candidates only
    read it); outside, each call walks it anew. ``tests/test_grad_sync_walk.py``: the same prices."""
    _WALKED.append((tg, _walk_of(tg)))
    try:
        yield
    finally:
        _WALKED.pop()


def shared_reshards_s(
    uses: Iterable[Use], infos: dict, choice: dict[str, Strategy], comm: CommModel, matmul_s=None
) -> float:
    """Seconds of the reshards that uses share (``reshard_key``) beyond the first of each: the cost
    tables price every use on its own (a graph output's without a gradient), codegen runs one.
    ``uses``: ``plan_uses`` of the plan; ``matmul_s``: ``use_run_s``'s."""
    total = 0.0
    for u in uses:
        if not u.runs:
            total += use_run_s(u, infos, choice, comm, matmul_s)
    return total


def use_run_s(u: Use, infos: dict, choice: dict[str, Strategy], comm: CommModel, matmul_s=None) -> float:
    """Seconds of the reshard of use ``u`` as the tables price it (a graph output's without a
    gradient), less what its collective matmuls hide where the plan runs them (``matmul_s``: the
    chosen strategy's compute of each linear, ``costs.overlap_price``; None: they are off)."""
    info = infos[u.inp.name]
    have = choice[u.src].out
    rg = info.requires_grad and u.user.op == "call_function"
    t = comm.reshard(have, u.need, info.moved_bytes, rg, u.fops)[0]
    if matmul_s is not None and u.user.op == "call_function":
        state = infos[u.src].role in (Role.PARAM, Role.BUFFER)
        t -= overlap_price(
            comm, u.user, u.k, u.inp, have, u.need, info.moved_bytes, rg, u.fops, matmul_s,
            choice[u.user.name].out, state, (is_grid(choice[u.src]), is_grid(choice[u.user.name])),
        )  # fmt: skip
    return t


@dataclass(frozen=True)
class Bucket:
    """Deferred parameter gradients all-reduced as one flat tensor (``codegen/grad_sync.py``)."""

    axes: tuple[int, ...]  # mesh axes, the first asynchronous, the others when backward ends
    params: tuple[str, ...]  # parameter placeholders, in the order backward completes them
    nbytes: float  # local bytes per rank (the sum of the members' local pieces)
    ready: int  # graph position of the op whose backward completes the bucket (its earliest use)
    # reduce-scattered into ZeRO-1's shares (each rank receives its own), else all-reduced
    scatter: bool = False


def grad_buckets(
    tg: TracedGraph,
    choice: dict[str, Strategy],
    deferred: dict[str, tuple[int, ...]],
    mesh_shape: Sequence[int],
    cap: float | None = None,
    grad_dtype: torch.dtype | None = None,
    scatter_axes: Collection[int] = (),
) -> list[Bucket]:
    """The deferred parameters in buckets, as DistributedDataParallel forms them, in the order
    backward completes the buckets.

    A parameter's gradient is complete when backward reaches its first use in graph order.
    Parameters are taken in that order, the latest first (ties: the later placeholder first).
    Consecutive parameters with the same axes and dtype share a bucket until it holds ``cap``
    bytes (default ``BUCKET_BYTES``). A bucket is reduced once every member's gradient is
    complete. Codegen and the cost model both call this function, so they form the same buckets.
    ``grad_dtype``: the dtype a floating parameter's gradient has at run time where it is not the
    traced one: fp32 under mixed precision, whose parameters are fp32 masters
    (``codegen/zero.py``), a model traced in bf16 included (``passes/precision.py:grad_dtype``).
    ``scatter_axes``: ZeRO-1's data axes; a parameter its optimizer cuts into shares over exactly
    its reduction axes (``scatters``) goes to a bucket of such parameters, reduce-scattered."""
    cap = BUCKET_BYTES if cap is None else cap
    order = {n.name: i for i, n in enumerate(tg.graph.nodes)}
    nodes = {n.name: n for n in tg.graph.nodes if n.name in deferred}

    def first_use(p: str) -> int:
        return min((order[u.name] for u in nodes[p].users), default=order[p])

    ranked = sorted(deferred, key=lambda p: (-first_use(p), -order[p]))
    open_: dict[tuple, list[str]] = {}
    size: dict[tuple, float] = {}
    done: list[tuple[tuple, list[str], float]] = []
    for p in ranked:
        val = nodes[p].meta["val"]
        dtype = grad_dtype if grad_dtype is not None and val.dtype.is_floating_point else val.dtype
        key = (deferred[p], dtype, scatters(val.shape, choice[p].out, deferred[p], scatter_axes, mesh_shape))
        b = val.numel() * dtype.itemsize / volume_factor(choice[p].out, mesh_shape)
        open_.setdefault(key, []).append(p)
        size[key] = size.get(key, 0.0) + b
        if size[key] >= cap:
            done.append((key, open_.pop(key), size.pop(key)))
    done += [(key, ps, size[key]) for key, ps in open_.items()]
    buckets = [Bucket(key[0], tuple(ps), nb, min(first_use(p) for p in ps), key[2]) for key, ps, nb in done]
    return sorted(buckets, key=lambda b: -b.ready)


def share_cut_of(
    shape: Sequence[int], spec: Spec, scatter_axes: Collection[int], mesh_shape: Sequence[int]
) -> tuple[tuple[int, ...], int]:
    """The data axes ZeRO-1's optimizer cuts a parameter of ``shape`` stored as ``spec`` into
    shares over, and the dim of its local piece it cuts (``codegen/zero_one.py:share_cut`` runs
    this rule on the parameter itself; ``(), 0``: none, the parameter is its own share). The axes:
    those of ``scatter_axes`` of more than one rank it is whole on, in mesh order; none for a
    scalar. The dim: one whose cut DTensor's placement for the share says exactly
    (``codegen/zero_one.py:share_placements``), so checkpoints and ``full_tensor`` read the
    shares right:

    * dim 0 where its local size divides by the axes' sizes' product ``d``, or where the cut is
      over one axis: ``torch.chunk``'s cut of the local piece (``ceil(rows / d)`` a share, the last
      ones shorter or empty), which is DTensor's own uneven ``Shard(0)``, and, where a later axis
      cuts dim 0 too (a column-parallel weight ``[out, in]`` stored ``S(0)`` on the tensor axis),
      its uneven ``_StridedShard(0)`` over the later axes' pieces as FSDP2 writes it over tensor
      parallelism (DTensor cuts it so since pytorch/pytorch#150490, torch 2.8; the project needs
      2.11). Over several axes DTensor nests the cut (chunk ``i_1`` of chunk ``i_0``), which
      differs from the shares' for most sizes ``d`` does not divide: taken only where it does not
      (``nested_cut_is_chunk``) and no later axis cuts dim 0.
    * else the first other dim no mesh axis cuts and ``d`` divides (a weight replicated over two
      data axes whose rows do not divide by their product, but whose columns do): a plain
      ``Shard(dim)`` on each data axis.

    Megatron-LM's distributed optimizer shards every parameter whatever its shape (its buffer is
    flat); a parameter left uncut is stepped whole on every rank and its gradient all-reduced
    (before the strided uneven cut, Megatron's 32B row, DP 48 over TP-8 pieces of 7168 / 8 = 896
    rows, left 9 of its 14 GiB of gradients so)."""
    on = tuple(a for a in sorted(scatter_axes) if mesh_shape[a] > 1 and is_replicate(spec[a]))
    if not on or not len(shape):
        return (), 0
    nd, d = len(shape), math.prod(mesh_shape[a] for a in on)
    local = local_shape(shape, spec, mesh_shape)
    sizes = [mesh_shape[a] for a in on]
    later = any(b > on[0] and b not in on and is_shard(q) and q.dim % nd == 0 for b, q in enumerate(spec))
    if local[0] % d == 0 or len(on) == 1 or (not later and nested_cut_is_chunk(local[0], sizes)):
        return on, 0
    for k in range(1, nd):
        if local[k] % d == 0 and not any(is_shard(q) and q.dim % nd == k for q in spec):
            return on, k
    return (), 0


def nested_cut_is_chunk(n: int, sizes: Sequence[int]) -> bool:
    """Whether DTensor's nested cut of ``n`` over axes of ``sizes`` (``Shard`` on each, the outer
    first: rank ``(i_0, i_1, ...)`` holds chunk ``i_1`` of chunk ``i_0``, each ``torch.chunk``'s) is
    ``torch.chunk``'s cut of ``n`` into ``prod(sizes)``, share ``i_0 n_1 + i_1`` on that rank (the
    shares' cut): always where the product divides ``n``, for some sizes it does not."""

    def chunk(m: int, k: int, r: int) -> tuple[int, int]:
        c = -(-m // k)
        return min(m, r * c), min(m, (r + 1) * c)

    d = math.prod(sizes)
    for r in range(d):
        lo, hi, rest = 0, n, r
        for k, s in enumerate(sizes):
            i = rest // math.prod(sizes[k + 1 :])
            rest -= i * math.prod(sizes[k + 1 :])
            a, b = chunk(hi - lo, s, i)
            lo, hi = lo + a, lo + b
        a, b = chunk(n, d, r)
        if (hi - lo, lo if hi > lo else 0) != (b - a, a if b > a else 0):
            return False
    return True


def share_axes_of(
    shape: Sequence[int], spec: Spec, scatter_axes: Collection[int], mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    """The data axes ZeRO-1's optimizer cuts a parameter of ``shape`` stored as ``spec`` into
    shares over (``share_cut_of``'s axes); none where it is its own share on every rank."""
    return share_cut_of(shape, spec, scatter_axes, mesh_shape)[0]


def scatters(
    shape: Sequence[int],
    spec: Spec,
    axes: tuple[int, ...],
    scatter_axes: Collection[int],
    mesh_shape: Sequence[int],
) -> bool:
    """Whether ZeRO-1 reduce-scatters the gradient of a parameter of ``shape`` stored as ``spec``
    and reduced over ``axes``: its optimizer cuts it into shares (``share_axes_of``) over exactly
    ``axes``."""
    on = share_axes_of(shape, spec, scatter_axes, mesh_shape)
    return bool(on) and tuple(sorted(axes)) == on


def bucket_all_reduce_s(bucket: Bucket, comm: CommModel) -> tuple[float, float]:
    """Seconds of a bucket's all-reduce: issued on an idle stream, and issued behind another still
    in flight (only the first axis's runs queued; the others follow it when backward ends). A
    scattered bucket (``Bucket.scatter``) reduce-scatters instead, the outer axis first, each next
    axis on what the previous left (``1/n`` of it): no queued prices exist for reduce-scatters."""
    if bucket.scatter:
        t, nbytes = 0.0, bucket.nbytes
        for a in sorted(bucket.axes):
            t += comm.time(Collective.REDUCE_SCATTER, nbytes, a)
            nbytes /= comm.mesh_shape[a]
        return t, t
    first = comm.time(Collective.ALL_REDUCE, bucket.nbytes, bucket.axes[0])
    rest = sum(comm.time(Collective.ALL_REDUCE, bucket.nbytes, a) for a in bucket.axes[1:])
    return first + rest, comm.queued_all_reduce_time(bucket.nbytes, bucket.axes[0]) + rest


def bucket_copy_s(bucket: Bucket, cluster) -> float:
    """Seconds of flattening a bucket of two or more gradients into one tensor (``flatten_s``); a
    bucket of one is reduced in place."""
    return flatten_s(bucket.nbytes, cluster) if len(bucket.params) > 1 else 0.0


def bucket_transients(buckets: Sequence[Bucket], fsdp: Collection[str] = ()) -> dict[float, float]:
    """Graph position -> bytes that flattening a bucket allocates there, beyond its members'
    gradients (``torch.cat``, when backward completes the bucket; the gradients then become views
    of it and the old ones are freed, so only this moment holds both). A bucket of one is reduced
    in place; a bucket of parameters FSDP2 reduces (``fsdp``) only is never made (one that mixes
    them with others counts whole: an upper bound)."""
    out: dict[float, float] = {}
    for b in buckets:
        if len(b.params) > 1 and not set(b.params) <= set(fsdp):
            out[b.ready] = max(out.get(b.ready, 0.0), b.nbytes)
    return out


def deferred_grad_axes(
    tg: TracedGraph, choice: dict[str, Strategy], mesh_shape: Sequence[int]
) -> dict[str, tuple[int, ...]]:
    """Parameter placeholder name -> mesh axes its accumulated gradient is all-reduced over after
    backward produces it; parameters not listed keep their "f" inline.

    A use counts where the parameter is read, or, through a *replicated chain*, where a value
    computed from it alone is: ops whose every other tensor input carries no gradient and whose
    output is Replicate on the "f" axes ``D``, as the parameter is (GPT-2's position embedding:
    ``wpe`` -> ``embedding(wpe, positions)`` -> cast, added to the batch-split token embeddings, the
    "f" on the add). Such a chain computes the same values on every rank of ``D``, and its backward
    is linear in the gradient, so an all-reduce over ``D`` at its end equals one of the parameter's
    accumulated gradient: the "f"s at the chain's ends are left out (``deferred_sources``) and the
    parameter's gradient joins a bucket."""
    params = {p.name for p in tg.placeholders if p.role is Role.PARAM}
    out: dict[str, tuple[int, ...]] = {}
    grads = _grads(tg)
    for node in tg.graph.nodes:
        if node.name not in params or not _needs_grad(node):
            continue
        sets: set[tuple[int, ...]] = set()
        chain: list[fx.Node] = []
        _collect_uses(node, choice, mesh_shape, sets, chain, grads)
        if len(sets) == 1:
            (axes,) = sets
            if axes and all(_same_on(choice[c.name].out, axes) for c in [node, *chain]):
                out[node.name] = axes
    return out


def _collect_uses(
    node: fx.Node, choice: dict[str, Strategy], mesh_shape: Sequence[int], sets: set, chain: list, grads: set
) -> None:
    """The pure-"f" axes of every use of ``node`` into ``sets`` (``()``: a use that rules the
    deferral out), going through the ops of a replicated chain (``deferred_grad_axes``), which
    are appended to ``chain``."""
    stored = choice[node.name].out
    for user in node.users:
        if user.op != "call_function" or user.name not in choice:
            sets.add(())  # the output or an unknown consumer: never defer
            continue
        s = choice[user.name]
        for k, inp in enumerate(tensor_inputs(user)):
            if inp is not node:
                continue
            axes = pure_f_axes(stored, s, k, mesh_shape)
            if axes or f_axes(s, k) or not _passes_through(user, node, grads):
                sets.add(axes)
            elif user not in chain:
                chain.append(user)
                _collect_uses(user, choice, mesh_shape, sets, chain, grads)


def _passes_through(user: fx.Node, src: fx.Node, grads: set[str]) -> bool:
    """Whether ``user`` may be a link of a replicated chain from ``src``: one tensor output, no
    input written, and no tensor input other than ``src`` that carries a gradient (``grads``)."""
    if (
        user.target is operator.getitem
        or writes_inputs(user)
        or not isinstance(user.meta.get("val"), torch.Tensor)
    ):
        return False
    return all(inp is src or inp.name not in grads for inp in user.all_input_nodes)


def _carries_grad(tg: TracedGraph) -> set[str]:
    """The nodes whose values carry a gradient back: trainable parameters, and the floating
    results of ops that read one (the traced values' own ``requires_grad`` is off for activations)."""
    out: set[str] = set()
    for n in tg.graph.nodes:
        if n.op == "placeholder":
            if _needs_grad(n):
                out.add(n.name)
        elif n.op == "call_function" and any(i.name in out for i in n.all_input_nodes):
            vals = pytree.tree_leaves(n.meta.get("val"))
            if any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in vals):
                out.add(n.name)
    return out


def _same_on(spec: Spec, axes: tuple[int, ...]) -> bool:
    """Whether a value placed ``spec`` holds the same values on every rank of each of ``axes``."""
    return all(is_replicate(spec[a]) for a in axes)


def deferred_sources(
    tg: TracedGraph, choice: dict[str, Strategy], deferred: dict[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """``deferred`` (parameter -> axes) and, under the same axes, the nodes of each one's
    replicated chain (``deferred_grad_axes``): every producer whose uses' "f" on those axes codegen
    leaves out (``plan_uses``, ``codegen/lower.py``)."""
    if not deferred:
        return deferred
    out = dict(deferred)
    nodes = {n.name: n for n in tg.graph.nodes if n.name in deferred}
    grads = _grads(tg)
    for name, axes in deferred.items():
        node = nodes.get(name)
        if node is None:
            continue
        stack = [node]
        while stack:
            x = stack.pop()
            for user in x.users:
                if user.name in out or user.op != "call_function" or user.name not in choice:
                    continue
                s = choice[user.name]
                ks = [k for k, inp in enumerate(tensor_inputs(user)) if inp is x]
                if (
                    ks
                    and not any(set(f_axes(s, k)) & set(axes) for k in ks)
                    and _passes_through(user, x, grads)
                    and _same_on(s.out, axes)
                ):
                    out[user.name] = axes
                    stack.append(user)
    return out


def _needs_grad(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return getattr(val, "requires_grad", False) and val.dtype.is_floating_point


@dataclass(frozen=True)
class GradSyncCost:
    """What overlapping the deferred gradient all-reduces changes in a plan's step time [s].

    The cost tables price each use's reshard and "f" (``inline_f_s`` in all, beyond what runs
    inline: a parameter's pure "f" at its share of a bucket, ``use_price.use_price``, and a bucket's
    fixed price once per axis where any use has one); what runs is one all-reduce per gradient bucket
    (``allreduce_s`` in all; ``buckets``), of which ``hidden_s`` runs behind backward compute
    (``cost_model/overlap.py``), and the flattening of the buckets (``copy_s``). The step time
    is the tables' total plus ``adjustment_s``."""

    deferred: dict[str, tuple[int, ...]]
    inline_f_s: float
    allreduce_s: float
    hidden_s: float
    shared_s: float = 0.0  # the reshards that uses share (``reshard_key``), priced per use by the tables
    copy_s: float = 0.0  # flattening the buckets (``bucket_copy_s``)
    buckets: tuple[Bucket, ...] = ()
    # parameters FSDP2 reduces under ZeRO-2/3 (``codegen/zero.py:sharded_params``): the plan's
    # buckets price their time (an upper bound), but at run time FSDP2 reduce-scatters them per
    # group, so no bucket of theirs alone is flattened (``bucket_transients``)
    fsdp: frozenset[str] = frozenset()
    # ZeRO-1's parameter all-gathers in flight between the optimizer step and the forward that
    # waits for them (``zero_one_gathers_bytes``), and what the gradients reduce-scattered into
    # shares free by then, which the tables count whole: the step's position holds
    # ``step_gathers_bytes`` beyond what the tables charge there
    gathers_bytes: float = 0.0
    shares_saved_bytes: float = 0.0

    def step_gathers_bytes(self, stages: int = 1) -> float:
        """The bytes ZeRO-1's gathers add at the optimizer step beyond the tables' charge there; on
        one of ``stages`` pipeline ranks, whose gradients are about ``1 / stages`` of the model's
        (the largest buckets in flight are a bound for any rank's)."""
        return max(0.0, self.gathers_bytes - self.shares_saved_bytes / max(stages, 1))

    @property
    def adjustment_s(self) -> float:
        return self.allreduce_s + self.copy_s - self.inline_f_s - self.hidden_s - self.shared_s


def price_grad_sync(
    tg: TracedGraph,
    infos: dict,
    choice: dict[str, Strategy],
    compute_s: dict[str, float],
    comm: CommModel,
    efficiency: float,
    outputs: Outputs = Outputs.FULL,
    bucket_axes: Collection[int] = (),
    matmul_s=None,
    micro_batches: int = 1,
    grad_dtype: torch.dtype | None = None,
    scatter_axes: Collection[int] = (),
    gather_dtype: torch.dtype | None = None,
) -> GradSyncCost:
    """Price the deferred all-reduces of a plan on the backward timeline.

    Backward runs the graph's ops in reverse; op ``v``'s step on the compute stream is the
    backward share of its compute (``BACKWARD_FACTOR / (1 + BACKWARD_FACTOR)`` of ``compute_s[v]``,
    the op's forward + backward seconds) and half of the collectives on its input edges as they
    run (a forward collective's backward is its transpose, of the same size). A gradient
    bucket's all-reduce is issued after the step that completes it: the first use in graph order
    of its earliest-used member, the last of their uses that backward reaches. ``bucket_axes``:
    the tables' data-parallel axes, where they price a parameter's "f" as a bucket share
    (``CostTables.bucket_fixed``). ``matmul_s``: each linear's compute under the plan, where it
    runs collective matmuls (``use_run_s``); a use's reshard runs what they leave exposed.

    With ``micro_batches`` ``k > 1`` the buckets are reduced in the last micro-batch's backward
    only (``ParallelModule.step`` turns the reductions off for the others: ``GradSync.
    set_requires_gradient_sync``), so the timeline is that backward: each step ``1/k`` of the
    tables' compute and collectives, which hold the whole step's. Megatron-LM does the same
    (``--overlap-grad-reduce``: its schedules run every micro-batch but the last under the
    DDP's ``no_sync``, ``megatron/core/pipeline_parallel/schedules.py``), so there too only the last
    micro-batch's backward hides the data-parallel reduction. ``grad_dtype``: the gradients' dtype
    at run time (``grad_buckets``): the buckets hold, and the all-reduces send, what runs;
    ``scatter_axes``: ZeRO-1's data axes, whose shares' buckets are reduce-scattered;
    ``gather_dtype``: what ZeRO-1's parameter all-gathers send where it is not the traced dtype
    (the half copies under mixed precision, ``passes/precision.py:compute_param_dtype``)."""
    mesh = comm.mesh_shape
    share = 1.0 / max(micro_batches, 1)  # of the tables' seconds, in the backward that reduces
    deferred = deferred_grad_axes(tg, choice, mesh)
    grad_total = trainable_bytes(tg, infos)
    fixed_axes: set[int] = set()  # axes where the tables charged a bucket's fixed price
    bwd_share = BACKWARD_FACTOR / (1 + BACKWARD_FACTOR)
    steps: list[tuple[float, list[float]]] = []
    first_use: dict[str, int] = {}  # deferred parameter -> index of its first use's step
    inline_f = 0.0
    every = list(plan_uses(tg, choice, deferred, outputs))
    uses: dict[str, list[Use]] = {}
    for u in every:
        uses.setdefault(u.user.name, []).append(u)
    for node in tg.graph.nodes:
        if node.op != "call_function" or node.name not in choice or node.target is operator.getitem:
            continue
        s = choice[node.name]
        t_comm = 0.0
        for u in uses.get(node.name, ()):
            info = infos[u.inp.name]
            have, rg = choice[u.src].out, info.requires_grad
            # what the tables charged (a parameter's pure "f" as a bucket share), and what runs inline
            param = grad_total if infos[u.src].role is Role.PARAM and rg else 0.0
            priced, bucketed = use_price(
                comm, have, u.need, info.moved_bytes, rg, f_axes(s, u.k), param, bucket_axes
            )
            run = use_run_s(u, infos, choice, comm, matmul_s)
            priced -= comm.reshard(have, u.need, info.moved_bytes, rg, u.fops)[0] - run  # the matmuls' part
            fixed_axes.update(bucketed)
            inline_f += priced - run
            if u.src in deferred:
                first_use.setdefault(u.src, len(steps))
            t_comm += run * (0.5 if rg and u.runs else 0.0)
        rg = infos[node.name].requires_grad
        steps.append(((compute_s.get(node.name, 0.0) * (bwd_share if rg else 0.0) + t_comm) * share, []))
    allreduce = copy = 0.0
    buckets = grad_buckets(tg, choice, deferred, mesh, grad_dtype=grad_dtype, scatter_axes=scatter_axes)
    for b in buckets:
        t, t_q = bucket_all_reduce_s(b, comm)
        allreduce += t
        copy += bucket_copy_s(b, comm.cluster)
        steps[min(first_use[p] for p in b.params)][1].append((t, t_q))
    inline_f += sum(bucket_fixed_s(comm, a) for a in fixed_axes)
    hidden = hidden_seconds(list(reversed(steps)), efficiency)
    shared = shared_reshards_s(every, infos, choice, comm, matmul_s)
    # at the step, a reduce-scattered bucket's gradients are this rank's shares only, where the
    # tables hold them whole: the gathers in flight then add only what exceeds that
    saved = sum(b.nbytes * (1 - 1 / math.prod(mesh[a] for a in b.axes)) for b in buckets if b.scatter)
    gathers = zero_one_gathers_bytes(tg, choice, mesh, scatter_axes, gather_dtype)
    return GradSyncCost(
        deferred, inline_f, allreduce, hidden, shared, copy, tuple(buckets),
        gathers_bytes=gathers, shares_saved_bytes=saved,
    )  # fmt: skip


def share_slot_elements(local: Sequence[int], d: int, dim: int = 0) -> int:
    """Elements one of ``d`` shares of a local piece of shape ``local`` cut on ``dim`` takes in a
    gather or reduce-scatter: ``ceil(local[dim] / d)`` of that dim's slices, every share padded to
    that (``torch.chunk``'s cut; ``codegen/zero_one.py:share_rows``)."""
    return -(-local[dim] // d) * (math.prod(local) // max(local[dim], 1))


def zero_one_gathers_bytes(
    tg: TracedGraph,
    choice: dict[str, Strategy],
    mesh_shape: Sequence[int],
    scatter_axes: Collection[int],
    param_dtype: torch.dtype | None = None,
    cap: float = ZERO_ONE_BUCKET_BYTES,
    in_flight: int = ZERO_ONE_IN_FLIGHT,
) -> float:
    """The most bytes ZeRO-1's parameter all-gathers hold at once (``codegen/zero_one.py``): after
    the optimizer step, the parameters cut into shares (``share_cut_of`` over ``scatter_axes``) are
    gathered in buckets, in the order the forward first reads them, each filling about ``cap``
    bytes of gathered parameters, ``in_flight`` of them at a time. A bucket in flight holds its
    gathered parameters (every rank's slot) and this rank's shares concatenated to send (``1 / d``
    of that), until the forward waits for it and its parts are copied into place. They start while
    the step's gradients are still held (a training loop zeroes them after ``step`` returns), so the
    plan's peak counts them at the step's position (``plan_peak``). ``param_dtype``: the dtype the
    gathers send where it is not the traced one (the half copies of the masters under mixed
    precision, ``passes/precision.py:compute_param_dtype``: ``codegen/zero_one.py`` gathers half). 0 without ZeRO-1's axes. Buckets of one dtype and one set of axes, as codegen
    forms them, are not told apart here (a model has one of each under one plan)."""
    if not scatter_axes:
        return 0.0
    order = {n.name: i for i, n in enumerate(tg.graph.nodes)}
    params = {p.name for p in tg.placeholders if p.role is Role.PARAM}
    sizes: list[tuple[int, float, int]] = []  # (first read, gathered bytes, d)
    for node in tg.graph.nodes:
        if node.name not in params or node.name not in choice or not _needs_grad(node):
            continue
        val, spec = node.meta["val"], choice[node.name].out
        on, dim = share_cut_of(tuple(val.shape), spec, scatter_axes, mesh_shape)
        if not on:
            continue
        d = math.prod(mesh_shape[a] for a in on)
        dtype = param_dtype if param_dtype is not None and val.dtype.is_floating_point else val.dtype
        local = local_shape(tuple(val.shape), spec, mesh_shape)
        slot = share_slot_elements(local, d, dim)
        first = min((order[u.name] for u in node.users), default=order[node.name])
        sizes.append((first, d * slot * dtype.itemsize, d))
    buckets: list[float] = []
    size = 0.0
    for _, nbytes, d in sorted(sizes, key=lambda x: x[0]):
        if buckets and size + nbytes <= cap:
            buckets[-1] += nbytes * (1 + 1 / d)
            size += nbytes
        else:
            buckets.append(nbytes * (1 + 1 / d))
            size = nbytes
    n = min(in_flight, len(buckets))
    return max((sum(buckets[j : j + n]) for j in range(len(buckets) - n + 1)), default=0.0)


def reduced_after_schedule(gs: GradSyncCost, comm: CommModel, efficiency: float) -> GradSyncCost:
    """``gs`` as a pipelined step runs its buckets: ``PipelinedModule.step`` (``codegen/
    pipeline.py``) turns the reductions off while the schedule runs every micro-batch's backward
    and reduces every bucket once it has ended (``GradSync.finish``), so none hides behind
    backward compute: the buckets are issued together, the first on an idle stream and the others
    queued behind it (``cost_model/overlap.py``: only what queueing saves; nothing on a preset
    without queued prices). Megatron-LM starts each model chunk's reduction as that chunk's last
    backward ends, which autopar's pipelined runtime does not: priced as it runs."""
    burst = [(0.0, [bucket_all_reduce_s(b, comm) for b in gs.buckets])]
    return dataclasses.replace(gs, hidden_s=hidden_seconds(burst, efficiency))
