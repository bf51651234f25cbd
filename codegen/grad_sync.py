"""Asynchronous, bucketed gradient all-reduce of parameters, overlapped with the rest of backward.

For the parameters ``passes/grad_sync.py`` selects (every use needs the same pure "f"), the
generated graph has no "f"; instead the parameters are grouped into buckets
(``passes/grad_sync.py:grad_buckets``, as ``DistributedDataParallel`` groups them) and each gets
two hooks:

* a tensor hook, which sees the gradient ``g`` autograd is about to accumulate:

  - ``.grad`` is None (the usual step): lets ``g`` through and marks the parameter;
  - ``.grad`` already holds a value (zeroed rather than set to None, or gradients accumulated
    over backwards that each reduce): hands a copy of ``g`` to the bucket and lets zeros through, so the
    reduced copy is added to ``.grad`` when it arrives: an accumulated gradient is never
    reduced twice;
  - this backward will not accumulate into ``.grad`` (``torch.autograd.grad``): all-reduces ``g``
    inline, exactly as the "f" would have;

* a post-accumulate-grad hook, which hands ``p.grad`` of a marked parameter to its bucket.

When every member of a bucket has handed its gradient in, the bucket starts one asynchronous
all-reduce: of that gradient itself for a bucket of one, else of ``torch.cat`` of the members'
gradients, whose slices then become the members' ``.grad`` (so the reduced values land there with
no copy back, and the old gradients are freed). The first reduction started in a backward queues a
callback that the autograd engine runs when backward ends (as ``DistributedDataParallel`` does): it
starts the buckets still incomplete (a parameter this backward did not reach), with the members
they have, then waits for every pending reduction (and adds the copies), so ``loss.backward()``
returns with the same gradients as the inline version. Every rank runs the same backward, so the
buckets start in the same order on all of them.

The forward may read a parameter through its plain leaf (``codegen/local_params.py``) rather than
through ``to_local``: then no hook of the parameter runs; the leaf's own post-accumulate hook, which
moves its gradient to the parameter's ``.grad``, first calls ``_leaf_grad`` (``LocalLeaf.set_sync``),
which does both hooks' work in one call on the gradient the leaf let go of: handed to the bucket as
it is (the bucket sets ``.grad`` once, over the reduced values), or handed in to be added to a
``.grad`` that holds values, or kept aside while accumulating. One Python call and one ``DTensor``
per parameter and step where the two hooks took a tensor hook, a taker and a post-accumulate hook
(``benchmarks/profile_vs_torch.py``). ``torch.autograd.grad`` through the leaves is not offered
(they are private); with ``ParallelModule.local_leaves`` off the parameters' own hooks serve it.

A bucket reduced over several mesh axes starts the first asynchronously and the others after
it completes (one process group per axis).

**Reduce-scattered buckets (ZeRO-1).** A bucket the plan marks ``scatter`` (``passes/grad_sync.py:
grad_buckets``: its members are the parameters ZeRO-1 cuts into shares over exactly the bucket's
axes, ``codegen/zero_one.py:share_axes``) is reduce-scattered: its members' gradients are laid
out share by share (``[d, n/d]`` each, concatenated along the second dim, ``d`` the shares; a share cut on
another dim than 0 copied contiguous into its slot), one
reduce-scatter per axis (the outer first, the next on what it left) gives each rank the
sum of its own shares, and each member's ``.grad`` becomes that share: a ``DTensor`` of the
parameter's global shape placed as its share (``Shard(dim)`` on those axes), so the value is whole
where read as a ``DTensor`` (``full_tensor``, ``clip_grad_norm_``), and ZeRO-1's step reads its
shares with no slicing. Half an all-reduce's bytes go over the link (Megatron-LM's distributed
optimizer reduce-scatters its gradient buffer so), and the gradients held after backward are
``1/d`` of the parameters'. A gradient accumulated onto such a ``.grad`` (not zeroed) is added
share-wise. Where a member turns out not to cut as the plan said, the bucket is all-reduced.

Gradient accumulation with one reduction (``ParallelModule.step`` over micro-batches, or a user's
loop). ``set_requires_gradient_sync(False)`` (or ``with grad_sync.accumulating():``, as
``DistributedDataParallel.no_sync``; the name is FSDP2's) turns the reductions off: the next
backwards accumulate their local, unreduced gradients with no communication, and the first
backward run with the sync back on reduces the accumulated sums, once:

* a parameter whose ``.grad`` was None when accumulation began accumulates into ``.grad`` itself
  (``_unreduced``); in the synced backward it is handled as a first gradient is: marked, and its
  ``.grad``, now the sum over every backward, handed to its bucket;
* a parameter whose ``.grad`` already held reduced values (zeroed, or kept from an earlier step)
  keeps them there and accumulates its local sum beside it (``_local``); the synced backward hands
  that sum plus its last gradient to the bucket as a copy to add, so no value is reduced twice;
* when the synced backward ends (``finish``), accumulated parameters it did not reach are handed
  in as well. ``finish`` may also be called after backward (``step`` does): it reduces what a
  backward that reached no bucketed parameter left, and otherwise does nothing.

Only these bucketed reductions wait for the last backward. The all-reduces the generated graph
runs inline (the "f" of tensor-parallel parameter uses) still run in each backward: reduction is
linear, so reducing each micro-batch's gradient and summing equals reducing the sum.
``reductions`` counts the bucket all-reduces started, so a test can see them run once per step.

**The loss rides** (``ParallelModule.loss_rides``, off by default). The forward of a data-parallel
module leaves the loss it returns (a sum across ranks, ``collectives.DeferredSum``) pending, handed
here (``add_rider``) where some bucket is all-reduced over exactly its group (``rides``). The first
such bucket started in the backward carries it: its value is appended to the bucket's flat buffer
and its slot read when the all-reduce completes (``DeferredSum.rode``), so a step runs no
collective for its loss, as ``DistributedDataParallel``, whose ranks read their own losses, runs
none. A bucket of one large gradient, reduced in place, carries none (``RIDE_COPY_BYTES``); one of
another dtype neither. A sum no bucket took is started on its own in ``finish`` (the loss's
backward queues it, so every backward through the loss ends with it started, on every rank alike).

**The count divides after the reduction** (``divide_after``). A token-mean loss whose ranks were
fed slices (``ParallelModule._scale_after``) runs backward on its sum over this rank's tokens, not
on its mean: the loss's backward registers the loss's ``[sum, count]`` (summed over the ranks in
the forward, or riding in the first bucket) here, and ``finish`` divides every gradient this
backward reduced by that count (the buckets' gradient slots, not the riders'; a ZeRO-1 share
before it lands), before the caller clips or steps, as Megatron-LM's ``calculate_per_token_loss``
scales its reduced gradients by the summed token count. So the count needs no all-reduce of its
own at the forward's top. A backward with the sync off, or with unreduced accumulated gradients,
is not divided here (``divide_after`` answers None): the loss's backward divides by the count first.

The mesh whose axes the buckets name is given at construction (``codegen/build.py`` passes the
module's own): the hooks run in backward, where no mesh is bound, and never read a global, so
modules on different meshes reduce their gradients on their own groups.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.codegen import collectives as C
from autopar.codegen.local_params import grad_like, leaf_of
from autopar.codegen.zero_one import (
    share_cut,
    share_index,
    share_of,
    share_placements,
    slot_elements,
    slots_of,
)

# a bucket of one gradient larger than this is all-reduced in place, without the sums that ride
RIDE_COPY_BYTES = 1 << 20


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a ``DTensor`` gradient (the parameters are ``DTensor``s, the
    reductions here run on their pieces), or ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _like(p: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """``piece`` (a local tensor) as a gradient of parameter ``p``: a ``DTensor`` of ``p``'s
    placements for a ``DTensor`` parameter (no communication), else ``piece``."""
    if isinstance(p, DTensor):
        return grad_like(p, piece)
    return piece


def _reduced(g: torch.Tensor, mesh: DeviceMesh, axes: Sequence[int]) -> torch.Tensor:
    """A new gradient: ``g``'s pieces summed over the ranks of each of ``axes``."""
    out = _local(g)
    for a in axes:
        out = C.reduce_sum(out, mesh, a)
    if isinstance(g, DTensor):
        return DTensor.from_local(out, g.device_mesh, g.placements, run_check=False)
    return out


def _accumulates(acc) -> bool:
    """Will the running backward accumulate into ``.grad`` through ``acc`` (its AccumulateGrad)?"""
    try:
        return torch._C._will_engine_execute_node(acc)
    except RuntimeError:  # raised for leaves under torch.autograd.grad, which never accumulates
        return False


class _Bucket:
    """Members' gradients handed in so far: parameter -> (tensor to reduce, added to .grad after).
    ``scatter``: the axes its members' shares are cut over (reduce-scattered), else (); ``dims``:
    id(member) -> the dim of its local piece its shares cut; ``shares`` and ``mine``: how many
    shares that cuts, and this rank's (``share_index``)."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        axes: tuple[int, ...],
        scatter: tuple[tuple[int, ...], dict[int, int]],
        mesh: DeviceMesh,
    ):
        self.params = list(params)
        self.size = len(self.params)
        self.keyed = [(p, id(p)) for p in self.params]  # each member with its key in ``ready``
        self.axes = axes
        self.scatter, self.dims = scatter
        self.shares = math.prod(mesh.size(a) for a in self.scatter)
        self.mine = share_index(mesh, self.scatter)
        self.ready: dict[int, tuple[torch.Tensor, bool]] = {}
        self.group = C.axis_group(mesh, axes[0])  # its first axis's group, looked up once


def _scatter_cut(
    params: Sequence[torch.nn.Parameter], axes: tuple[int, ...], mesh: DeviceMesh
) -> tuple[tuple[int, ...], dict[int, int]]:
    """The axes a bucket marked ``scatter`` reduce-scatters over, and id(member) -> the dim its
    shares cut: its axes in mesh order, where every member is cut into shares over exactly those
    (``share_cut``); else ``(), {}`` (all-reduced)."""
    on = tuple(sorted(axes))
    cuts = {id(p): share_cut(p, mesh, on) for p in params}
    return (
        (on, {k: dim for k, (_, dim) in cuts.items()}) if all(a == on for a, _ in cuts.values()) else ((), {})
    )


class GradSync:
    """``buckets``: lists of parameters, each reduced over its ``axes`` of ``mesh``, in the order
    backward completes them (``passes/grad_sync.py:grad_buckets``), and whether it is
    reduce-scattered into ZeRO-1's shares (module docstring; absent: False)."""

    def __init__(self, buckets: Sequence[tuple], mesh: DeviceMesh):
        self._mesh = mesh
        self._buckets = [
            _Bucket(b[0], b[1], _scatter_cut(b[0], b[1], mesh) if len(b) > 2 and b[2] else ((), {}), mesh)
            for b in buckets
        ]
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._marked: set[int] = set()
        self._param = {id(p): p for b in self._buckets for p in b.params}
        self._sync = True  # False: backward accumulates locally, no reduction (module docstring)
        self._unreduced: set[int] = set()  # .grad holds only local, unreduced sums
        self._local: dict[int, torch.Tensor] = {}  # unreduced sums kept beside a reduced .grad
        self.reductions = 0  # bucket reductions started so far
        self.scatters = 0  # of them, reduce-scatters (ZeRO-1's shares)
        self.divisions = 0  # backwards whose reduced gradients were divided by a count (``divide_after``)
        # started reductions: (bucket, the tensor reduced, its work, ([(param, slice) to add], how
        # many of its elements are gradients: the riders' slots end it)); a reduce-scattered
        # bucket's last item: (its members, the laid-out gradients)
        self._pending: list[tuple[_Bucket, torch.Tensor, object, list]] = []
        self._queued = False
        # the returned sums (the loss) waiting to ride in the next bucket (module docstring)
        self._riders: list[C.DeferredSum] = []
        # the summed ``[sum, count]`` of the loss whose backward runs on its sum: the gradients
        # reduced in this backward are divided by its count in ``finish`` (``divide_after``)
        self._divisor: C.DeferredSum | None = None
        # the groups of the buckets a sum may ride in: all-reduced over one axis
        self._ride_groups = {b.group.group_name for b in self._buckets if not b.scatter and len(b.axes) == 1}
        # each parameter's AccumulateGrad node, kept alive: the parameter holds it only weakly, and
        # a node rebuilt later would not be the one the engine runs
        self._accumulators = []
        for b in self._buckets:
            for p in b.params:
                acc = p.view_as(p).grad_fn.next_functions[0][0]
                self._accumulators.append(acc)
                p.register_hook(self._pre_hook(p, acc, b.axes))
                p.register_post_accumulate_grad_hook(self._post_hook)
                leaf = leaf_of(p)  # the plain leaf the forward may read instead (codegen/local_params.py)
                if leaf is not None:
                    leaf.set_sync(functools.partial(self._leaf_grad, p, id(p)))

    @property
    def axes(self) -> set[int]:
        """The mesh axes the buckets' all-reduces run on."""
        return {a for b in self._buckets for a in b.axes}

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients the buckets reduce."""
        return list(self._param.values())

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def requires_gradient_sync(self) -> bool:
        return self._sync

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """False: the following backwards accumulate gradients locally with no communication;
        True (the default): backward reduces, including what was accumulated (module docstring)."""
        self._sync = bool(requires)

    @contextmanager
    def accumulating(self) -> Iterator[GradSync]:
        """Backwards inside the block accumulate unreduced gradients with no communication; the
        first backward after it reduces the accumulated sums once. Restores the previous setting."""
        previous = self._sync
        self._sync = False
        try:
            yield self
        finally:
            self._sync = previous

    def rides(self, group) -> bool:
        """Whether a sum over ``group`` may ride in this backward's buckets: the sync is on and
        some bucket is all-reduced over ``group`` alone (``collectives.riding``)."""
        return self._sync and group.group_name in self._ride_groups

    def add_rider(self, rider: C.DeferredSum) -> None:
        """``rider`` (a pending sum) rides in the first bucket started over its group, or is
        started on its own when the backward ends (``finish``)."""
        self._riders.append(rider)

    def divide_after(self, total: C.DeferredSum):
        """The factor a token-mean loss's backward multiplies its gradient by when it runs on its
        loss's sum (``collectives.mean_deferred``), the gradients that this backward reduces being
        divided by ``total``'s count (``total``: the loss's ``[sum, count]``, summed over the ranks)
        where it ends, once reduced (Megatron-LM's ``calculate_per_token_loss``): 1 for the first
        such loss of a backward, ``count / its count`` for another; None where this backward will
        not reduce what it accumulates (the sync off, or gradients accumulated unreduced, whose
        division is the caller's: it divides before backward goes on)."""
        if not self._sync or self._unreduced or self._local:
            return None
        self.queue_finish()
        if self._divisor is None or self._divisor is total:
            self._divisor = total
            return 1.0
        return self._divisor.wait()[1] / total.wait()[1]  # a second loss in the same backward

    def _count(self) -> torch.Tensor | None:
        """The summed count the gradients reduced in this backward are divided by, or None."""
        d = self._divisor
        return d.wait()[1] if d is not None else None

    def queue_finish(self) -> None:
        """Run ``finish`` when the running backward ends (once)."""
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self.finish)

    def _pre_hook(self, p: torch.nn.Parameter, acc, axes: tuple[int, ...]):
        def hook(g: torch.Tensor) -> torch.Tensor:
            if not _accumulates(acc):
                reduced = _reduced(g, self._mesh, axes)
                c = self._count()
                return reduced if c is None else reduced / c.to(reduced.dtype)
            pid = id(p)
            if not self._sync:  # accumulate locally, reduce nothing
                if p.grad is None or pid in self._unreduced:
                    self._unreduced.add(pid)
                    return g
                local = self._local.get(pid)
                self._local[pid] = g.detach().clone() if local is None else local.add_(g)
                return torch.zeros_like(g)
            if pid in self._local:  # the local sum beside a reduced .grad, and this gradient
                self._hand_in(p, self._local.pop(pid).add_(g), add=True)
                return torch.zeros_like(g)
            if p.grad is None or pid in self._unreduced:
                self._unreduced.discard(pid)
                self._marked.add(pid)
                return g
            self._hand_in(p, g.detach().clone(), add=True)
            return torch.zeros_like(g)

        return hook

    def _leaf_grad(self, p: torch.nn.Parameter, pid: int, g: torch.Tensor) -> bool:
        """The gradient ``g`` of ``p``'s plain leaf, which backward accumulated there and the leaf
        let go of (``LocalLeaf.set_sync``): the tensor hook's and the post-accumulate hook's work
        in one call, on a gradient nobody else holds (so it is handed in as it is, never copied).
        True: taken (to the bucket, or kept aside); False: the leaf moves it to ``.grad``.

        * sync on, ``.grad`` None: to the bucket as it is, which sets ``.grad`` once, a ``DTensor``
          over the reduced values (one ``DTensor`` built per parameter and step);
        * sync on, ``.grad`` holds reduced values: to the bucket, the reduced copy added to
          ``.grad`` when it arrives;
        * sync on, ``.grad`` holds unreduced sums (``_unreduced``): added to them, the sum handed in;
          a local sum kept aside (``_local``): that sum plus ``g``, added when reduced;
        * sync off: accumulated locally (module docstring). ``pid``: ``id(p)``, bound once."""
        if not self._sync:
            if p.grad is None or pid in self._unreduced:
                self._unreduced.add(pid)
                return False
            local = self._local.get(pid)
            self._local[pid] = g if local is None else local.add_(g)
            return True
        if pid in self._local:
            self._hand_in(p, self._local.pop(pid).add_(g), add=True, pid=pid)
            return True
        if pid in self._unreduced:
            self._unreduced.discard(pid)
            grad = p.grad
            if grad is None:  # set to None meanwhile
                self._hand_in(p, g, add=False, pid=pid)
                return True
            _local(grad).add_(g)
            self._hand_in(p, grad, add=False, pid=pid)
            return True
        # ``_hand_in``, inlined: the one call a parameter makes on the usual path
        b = self._bucket_of[pid]
        ready = b.ready
        ready[pid] = (g, p.grad is not None)
        if len(ready) == b.size:
            self._start(b)
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self.finish)
        return True

    def _post_hook(self, p: torch.nn.Parameter) -> None:
        if id(p) in self._marked:
            self._marked.discard(id(p))
            self._hand_in(p, p.grad, add=False)

    def _hand_in(self, p: torch.nn.Parameter, grad: torch.Tensor, add: bool, pid: int | None = None) -> None:
        if pid is None:
            pid = id(p)
        b = self._bucket_of[pid]
        b.ready[pid] = (grad, add)
        if len(b.ready) == b.size:
            self._start(b)
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self.finish)

    def _start(self, b: _Bucket) -> None:
        ready = b.ready
        members = [(p, *ready[pid]) for p, pid in b.keyed if pid in ready]
        b.ready = {}
        if b.scatter:
            self._start_scatter(b, members)
            return
        riders = self._riding(b, members) if self._riders else ()
        if len(members) == 1 and not riders:
            (p, g, add) = members[0]
            flat = _local(g)
            adds = [(p, flat)] if add else []
            if not add and p.grad is None:  # taken from the leaf (``_take``)
                p.grad = _like(p, flat)
        else:
            # a plain gradient (a leaf's, the usual) costs no call; a DTensor's, its local piece
            pieces = [g if type(g) is torch.Tensor else _local(g) for _, g, _ in members]
            flat = torch.cat([g.reshape(-1) for g in pieces] + [r.elem.reshape(-1) for r in riders])
            adds, off = [], 0
            for (p, _, add), g in zip(members, pieces):
                n = g.numel()
                piece = flat[off : off + n].view_as(g)
                off += n
                if add:
                    adds.append((p, piece))
                    continue
                # the reduced values land in .grad, the old one freed: ``_like(p, piece)``, where
                # the parameter's piece is contiguous (then its strides are the slice's) and of
                # the slice's dtype and shape, wrapped by ``DTensor``'s C++ constructor under the
                # parameter's own spec, as ``local_params.grad_like`` does after comparing strides
                # (here one call, not its frame and two ``stride()``, per parameter and step)
                if type(p) is DTensor:
                    local = p._local_tensor
                    if piece.dtype == local.dtype and piece.shape == local.shape and local.is_contiguous():
                        p.grad = DTensor.__new__(DTensor, piece, p._spec, requires_grad=False)
                        continue
                p.grad = _like(p, piece)
        grads = flat.numel() - sum(r.elem.numel() for r in riders)  # the riders' slots end it
        work = dist.all_reduce(flat, group=b.group, async_op=True)
        if riders:
            off = flat.numel()
            for r in reversed(riders):  # their slots end the flat buffer
                n = r.elem.numel()
                off -= n
                r.rode(flat[off : off + n], work)
        self.reductions += 1
        self._pending.append((b, flat, work, (adds, grads)))

    def _riding(self, b: _Bucket, members: list) -> list[C.DeferredSum]:
        """The pending sums that ride in bucket ``b``'s all-reduce (taken off ``_riders``): those
        over its one axis's group, of its gradients' dtype and device. A bucket of one parameter
        carries them only where its gradient is small (``RIDE_COPY_BYTES``): it is all-reduced in
        place otherwise, and would be copied into a new buffer with the sums."""
        if len(b.axes) != 1 or b.scatter:
            return []
        g = _local(members[0][1])
        if len(members) == 1 and g.numel() * g.element_size() > RIDE_COPY_BYTES:
            return []
        name = b.group.group_name
        take, keep = [], []
        for r in self._riders:
            if r.group is None:  # started on its own meanwhile (read before backward)
                continue
            fits = r.group.group_name == name and r.elem.dtype == g.dtype and r.elem.device == g.device
            (take if fits else keep).append(r)
        self._riders = keep
        return take

    def _start_scatter(self, b: _Bucket, members: list) -> None:
        """Reduce-scatter ``members``' gradients into this rank's shares (module docstring): the
        outer axis's asynchronously, the others in ``finish``. Each member takes ``d`` slots of
        ``c`` rows of the dim its shares cut (``zero_one.slots_of``: each share's contiguous copy;
        an uneven cut padded with zeros). The whole gradients are dropped from ``.grad`` here (the
        laid-out copy holds them), so they are freed as it is."""
        d = b.shares
        rows, parts = [], []
        for p, g, add in members:
            rows.append(slots_of(_local(g), d, b.dims[id(p)]))
            parts.append(p)
            if not add:
                p.grad = None
        laid = rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)
        a = b.scatter[0]
        out = laid.new_empty(laid.numel() // self._mesh.size(a))
        work = C.scatter_into(out, laid.reshape(-1), group=C.axis_group(self._mesh, a), async_op=True)
        self.reductions += 1
        self.scatters += 1
        self._pending.append((b, out, work, (parts, laid)))  # laid: alive until the work completes

    def _land_scatter(self, b: _Bucket, out: torch.Tensor, parts: list, count: torch.Tensor | None) -> None:
        """The other axes' reduce-scatters, then each member's share as its ``.grad`` (divided by
        ``count``, the loss's, where backward ran on its sum: ``divide_after``)."""
        for a in b.scatter[1:]:
            nxt = out.new_empty(out.numel() // self._mesh.size(a))
            C.scatter_into(nxt, out, group=C.axis_group(self._mesh, a))
            out = nxt
        if count is not None:
            out.div_(count.to(out.dtype))
        d, r = b.shares, b.mine
        off = 0
        for p in parts:
            dim = b.dims[id(p)]
            shape = share_of(p._local_tensor, d, r, dim).shape
            piece = out[off : off + shape.numel()].view(shape)  # the slot: the share's contiguous copy
            off += slot_elements(p, d, dim)
            g = p.grad
            if g is not None and _local(g).shape == piece.shape:  # a share kept from an earlier backward
                _local(g).add_(piece)
                continue
            if g is not None:  # a whole gradient kept (set by hand): its share, plus this one
                piece = share_of(_local(g), d, r, dim) + piece
            p.grad = DTensor.from_local(
                piece,
                p.device_mesh,
                share_placements(p, b.scatter, dim),
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )

    def finish(self) -> None:
        """Start the incomplete buckets and wait for every reduction started in this backward
        (runs when backward ends). With the sync on, accumulated gradients this backward did not
        reach join their buckets first; called again after backward, it reduces what is left."""
        if self._sync:
            for pid in self._unreduced:
                p = self._param[pid]
                if p.grad is not None:
                    self._bucket_of[pid].ready[pid] = (p.grad, False)
            for pid, local in self._local.items():
                self._bucket_of[pid].ready[pid] = (local, True)
            self._unreduced, self._local = set(), {}
        for b in self._buckets:
            if b.ready:
                self._start(b)
        riders, self._riders = self._riders, []
        for r in riders:  # no bucket took them: on their own, every rank here alike
            r.start()
        pending, self._pending, self._queued = self._pending, [], False
        count, self._divisor = self._count(), None  # the loss's pair was summed in forward (or rides)
        self.divisions += count is not None
        for b, flat, work, adds in pending:
            work.wait()
            if b.scatter:
                self._land_scatter(b, flat, adds[0], count)
                continue
            for a in b.axes[1:]:
                dist.all_reduce(flat, group=C.axis_group(self._mesh, a))
            adds, grads = adds
            if count is not None:  # the gradients, reduced, over the loss's count (``divide_after``)
                flat[:grads].div_(count.to(flat.dtype))
            for p, piece in adds:
                if p.grad is None:  # set to None after it accumulated
                    p.grad = _like(p, piece)
                else:
                    _local(p.grad).add_(piece)
