"""ZeRO-1 over ``DTensor`` parameters: each data-parallel rank keeps and steps the optimizer state
of its share of every parameter, then the shares are all-gathered back into the parameters.

Why by hand: torch has no ZeRO-1 that takes ``DTensor`` parameters. ``ZeroRedundancyOptimizer``
broadcasts the parameters with c10d ops a ``DTensor`` has no sharding rule for ("Operator
c10d.broadcast_.default does not have a sharding strategy registered"), and FSDP2 always
reduce-scatters gradients (ZeRO-2). What is written here is the part neither does: the step on
shares and the gather after it; the step itself is the user's optimizer class, unchanged.

**Shares.** A parameter ``p`` (a ``DTensor`` whose placement on the data axis is ``Replicate``:
the gradient reduction made it whole there) is cut on one dim of its local piece into ``d`` parts,
``d`` the data axis's size; the rank at coordinate ``r`` on that axis owns part ``r``. Over
several data axes (expert parallelism beside data parallelism) a parameter is cut over those it is
whole on: ``d`` their sizes' product, ``r`` the coordinates read outer axis first (a dense weight
over both, an expert split on the expert axis over the data axis alone), and its parts gathered
back one axis at a time, the inner first. The part is a *share*, a ``DTensor`` whose local tensor
is a view of ``p``'s local piece (no copy) and whose placement on the data axis is
``Shard(dim)`` (``_StridedShard`` where a later axis also shards that dim, as FSDP2 writes it), so
that its optimizer state (``zeros_like(share)``) is ``1/d`` of the parameter's and checkpoints
(``torch.distributed.checkpoint``) see where each piece belongs. Which dim and which axes is one
rule, ``passes/grad_sync.py:share_cut_of`` (``share_cut`` here), which the gradient buckets'
reduce-scatters and their price follow too: dim 0 wherever DTensor's placement says the cut
exactly (even; over one axis, uneven too, strided over a tensor-parallel piece included), else the
first dim no mesh axis shards that the shares divide (a weight over two data axes whose rows do
not divide by their product: its columns; the share is then a strided view, and each gather or
reduce-scatter slot its contiguous copy, ``slots_of``), else none. A dim that does not divide by
``d`` is cut as ``torch.chunk`` cuts it (``share_rows``: ``ceil(n / d)`` a share, the last ones
shorter or empty; gathers carry padded slots), which is DTensor's own uneven ``Shard``. A
parameter the rule cuts nowhere (a scalar too) is its own share on every rank, stepped in full
everywhere; the plan prices every parameter's state as sharded.

**Step.** Each share's gradient is the parameter's gradient where the bucket was reduce-scattered
into the shares (``codegen/grad_sync.py``: ``.grad`` is then the share), else the matching view of
the parameter's all-reduced gradient; the
inner optimizer (``optimizer_class`` over the shares, whose ``param_groups`` are this object's,
so learning-rate schedulers work as on any optimizer) steps the shares in place, which updates
part ``r`` of each parameter; then each bucket of shares (its gather filling about ``BUCKET_BYTES``) is all-gathered
over the data axis, one collective per bucket, and the other ranks' parts copied into place.

**Half gathers under mixed precision** (``half``: ``passes/precision.py:compute_param_dtype``;
Megatron-LM's distributed optimizer gathers its bf16 parameters too). The forward reads half
copies of the parameters (``codegen/local_params.py``), so each owner casts its updated fp32
share to the half type and the all-gather sends that: half the bytes of an fp32 gather. Each
rank's fp32 parameter then holds its own share exact and the other ranks' half-rounded, which is
exact for the forward (the half copy of either is the value sent) but not for state: the exact
fp32 master of every share lives on its owner alone, in its own part of the parameter (the
share the inner optimizer steps). ``exact`` gathers those in fp32 back into every rank's
parameters (collective; once after a step, nothing until the next); ``ParallelModule`` calls it
before anything reads state (``full_state_dict``, ``state_dict`` and so DCP's save and load, the
optimizer-state methods: their ``_settle``), so no reader sees a rounded master. Gradients are
untouched by the rounding (``full_grads``, clip norms read them as they are).

**The gathers behind the next forward** (Megatron-LM's ``--overlap-param-gather``: its
distributed optimizer starts the first bucket's all-gather after the step and, in a forward
pre-hook, waits for bucket ``k`` and starts bucket ``k + 1``'s, ``megatron/core/distributed/
param_and_grad_buffer.py``). The buckets are formed in the order the next forward first reads the
parameters (``order``: ``ParallelModule.optimizer`` passes the generated graph's read order). The
step starts the first ``IN_FLIGHT`` buckets' all-gathers asynchronously and returns; each
parameter of a bucket in flight carries ``PENDING_ATTR``, and the generated code reads every
parameter through ``collectives.local``, which calls ``wait_param`` first: the bucket (and every
bucket before it) is waited for, its parts copied into place, and the next bucket's all-gather
started, so at most ``IN_FLIGHT`` buckets' gathered parts are held at once and bucket ``k + 1``
travels while the layers reading bucket ``k`` compute. Every rank reads its parameters in the same
order, so the all-gathers are issued in the same order everywhere. What reads parameters outside
the generated forward waits for all first: ``wait`` (``step`` itself, ``ParallelModule``'s
``state_dict``, ``full_state_dict``, ``load_state_dict`` and the optimizer-state methods through
``wait_params``); ``zero_grad`` touches gradients only and the gathers write parameters only, so it
does not wait (waiting there would serialize every gather, since a loop zeroes right after the
step). A user who reads ``pmodel.parameters()`` directly between the step and the next forward
calls ``opt.exact()`` first (``wait`` alone leaves half-rounded shares under mixed precision). ``overlap=False`` waits for every bucket inside ``step``: the same
collectives on the same values, so the same parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.codegen.collectives import gather_into
from autopar.codegen.local_params import PENDING_ATTR, clear_grads, wait_param, wait_params
from autopar.passes.grad_sync import (
    ZERO_ONE_BUCKET_BYTES,
    ZERO_ONE_IN_FLIGHT,
    share_cut_of,
    share_slot_elements,
)
from autopar.placement import is_shard

__all__ = [
    "PENDING_ATTR",
    "ZeroOneOptimizer",
    "share_axes",
    "share_cut",
    "share_index",
    "share_of",
    "share_placements",
    "share_rows",
    "slots_of",
    "slot_elements",
    "wait_param",
    "wait_params",
]

# the bytes one all-gather fills (a bucket's whole parameters: d shares each; so the buffers held
# in flight are at most IN_FLIGHT of these, whatever d is), and how many run at once between a step
# and the forward reading them; the cost model prices those buffers (passes/trades.py)
BUCKET_BYTES = ZERO_ONE_BUCKET_BYTES
IN_FLIGHT = ZERO_ONE_IN_FLIGHT


def share_placements(p: DTensor, axes: tuple[int, ...], dim: int = 0):
    """``p``'s placements with dim ``dim`` of its local piece cut over ``axes`` (the outer axis's
    coordinate the outer index, as DTensor nests a dim split on several axes: ``Shard(dim)`` on
    each, so that rank ``(i_0, i_1)`` holds chunk ``i_0 n_1 + i_1``, the share ``share_index``
    names). Where a later axis not among ``axes`` already shards that dim (tensor parallelism on
    dim 0), the shares cut each of its pieces, so each of ``axes`` is strided by those axes' sizes
    (``_StridedShard``, as FSDP2 writes its shards over a tensor-parallel piece)."""
    out = list(p.placements)
    for axis in axes:
        later = math.prod(
            p.device_mesh.size(b)
            for b, q in enumerate(p.placements)
            if b > axis and b not in axes and is_shard(q) and q.dim % max(p.dim(), 1) == dim
        )
        out[axis] = _StridedShard(dim, split_factor=later) if later > 1 else Shard(dim)
    return tuple(out)


def share_cut(p: torch.Tensor, mesh: DeviceMesh, axes: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """The data axes (of ``axes``) parameter ``p`` is cut into shares over, and the dim of its
    local piece cut, by the rule the gradient buckets follow (``passes/grad_sync.py:
    share_cut_of``, so a bucket of shares is reduce-scattered into them); none (``(), 0``) for a
    piece that is not contiguous: such a parameter is its own share on every rank."""
    if not isinstance(p, DTensor) or not p._local_tensor.is_contiguous():
        return (), 0
    return share_cut_of(p.shape, p.placements, axes, tuple(mesh.shape))


def share_axes(p: torch.Tensor, mesh: DeviceMesh, axes: Sequence[int]) -> tuple[int, ...]:
    """``share_cut``'s axes."""
    return share_cut(p, mesh, axes)[0]


def share_rows(rows: int, d: int, r: int) -> tuple[int, int, int]:
    """Share ``r`` of ``d`` of ``rows`` rows, as ``torch.chunk`` (and DTensor's ``Shard``) cut
    them: ``c = ceil(rows / d)`` rows a share, the last ones shorter or empty; (start, stop, c).
    Collectives carry ``c`` rows for every share (padded), so their pieces are equal."""
    c = -(-rows // d)
    return min(rows, r * c), min(rows, (r + 1) * c), c


def share_index(mesh: DeviceMesh, axes: tuple[int, ...]) -> int:
    """This rank's share index over ``axes``: the outer axis's coordinate the outer index."""
    r = 0
    for a in axes:
        r = r * mesh.size(a) + mesh.get_local_rank(a)
    return r


def share_of(local: torch.Tensor, d: int, r: int, dim: int = 0) -> torch.Tensor:
    """Share ``r`` of ``d`` of ``local`` cut on ``dim`` (``share_rows``): a view, no copy
    (not contiguous where ``dim`` is not the outer one)."""
    start, stop, _ = share_rows(local.shape[dim], d, r)
    return local.narrow(dim, start, stop - start)


def slot_elements(p: torch.Tensor, d: int, dim: int = 0) -> int:
    """Elements a share of ``p`` cut on ``dim`` takes in a gather or reduce-scatter: ``c`` rows
    of that dim (``share_rows``)."""
    return share_slot_elements(tuple(p._local_tensor.shape), d, dim)


def slots_of(local: torch.Tensor, d: int, dim: int = 0) -> torch.Tensor:
    """``local`` laid out as ``[d, slot]``: row ``q`` the contiguous copy of share ``q``
    (``share_of``, flattened), padded with zeros to ``slot_elements``. On dim 0 this is ``local``'s
    rows themselves (a view where they divide); on another dim each share is copied."""
    c = share_rows(local.shape[dim], d, 0)[2]
    if dim == 0:
        flat = local.reshape(local.shape[0], -1) if local.dim() else local.reshape(1, 1)
        if c * d > flat.shape[0]:
            flat = torch.cat([flat, flat.new_zeros(c * d - flat.shape[0], flat.shape[1])])
        return flat.reshape(d, -1)
    out = local.new_zeros(d, c * (local.numel() // max(local.shape[dim], 1)))
    for q in range(d):
        part = share_of(local, d, q, dim)
        out[q, : part.numel()].view(part.shape).copy_(part)
    return out


class ZeroOneOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` over this rank's shares of ``params`` on data axes ``axes`` of ``mesh``
    (module docstring; one axis as an int). ``step``, ``zero_grad``, ``param_groups`` and ``state_dict`` behave as the
    inner optimizer's; ``shares`` maps each parameter to the tensor the state is kept for.
    ``overlap``: the gathers run behind the next forward (module docstring), else inside ``step``;
    ``order``: the parameters in the order the forward reads them (the buckets' order; those not
    listed last, in ``params``' order); ``half``: the dtype the gathers send (mixed precision: the
    forward's half type; module docstring), None: the parameters' own."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        optimizer_class,
        mesh: DeviceMesh,
        axes: int | tuple[int, ...],
        *,
        overlap: bool = True,
        order: Sequence[torch.Tensor] = (),
        half: torch.dtype | None = None,
        **kwargs,
    ):
        self.params = [p for p in params if p.requires_grad]
        self.half = half
        # whether the parameters hold other ranks' shares rounded to ``half`` (since the last step)
        self.rounded = False
        self.mesh = mesh
        self.axes = (axes,) if isinstance(axes, int) else tuple(sorted(axes))
        self.overlap = overlap
        self._order: dict[int, int] = {}  # id(parameter) -> its first place in ``order``
        for t in order:
            self._order.setdefault(id(t), len(self._order))
        # the all-gathers started and not yet waited for: (bucket index, work, gathered parts)
        self._inflight: list[tuple[int, object, torch.Tensor]] = []
        self._next = 0  # the next bucket whose all-gather is to start
        self.shares: dict[int, torch.Tensor] = {}
        # (parameter, its share, the axes it is cut over, the dim of its local piece cut)
        self._split: list[tuple[torch.nn.Parameter, torch.Tensor, tuple[int, ...], int]] = []
        for p in self.params:
            on, dim = share_cut(p, mesh, self.axes)
            if not on:
                self.shares[id(p)] = p
                continue
            local = p._local_tensor.detach()
            share = torch.nn.Parameter(
                DTensor.from_local(
                    share_of(local, self._size(on), self._rank(on), dim),
                    mesh,
                    share_placements(p, on, dim),
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
            )
            self.shares[id(p)] = share
            self._split.append((p, share, on, dim))
        self.inner = optimizer_class([self.shares[id(p)] for p in self.params], **kwargs)
        super().__init__([self.shares[id(p)] for p in self.params], self.inner.defaults)
        # one set of groups and state: a scheduler changing a group's lr changes the inner one's
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self._buckets = self._bucket()

    @property
    def axis(self) -> int:
        """The outer data axis (one data axis: the one)."""
        return self.axes[0]

    def _sent(self, share: torch.Tensor) -> torch.dtype:
        """The dtype a share's gather sends: ``half`` for a floating share of another dtype."""
        dtype = share.dtype
        return self.half if self.half is not None and dtype.is_floating_point else dtype

    def _size(self, axes: tuple[int, ...]) -> int:
        return math.prod(self.mesh.size(a) for a in axes)

    def _rank(self, axes: tuple[int, ...]) -> int:
        return share_index(self.mesh, axes)

    def _bucket(self) -> list[list[tuple[torch.nn.Parameter, torch.Tensor, tuple[int, ...], int]]]:
        """The shares in buckets whose gathers fill about ``BUCKET_BYTES`` (one dtype and one set of
        axes each), in read order."""
        last = len(self._order)
        ranked = sorted(self._split, key=lambda ps: self._order.get(id(ps[0]), last))  # stable
        buckets, size = [[]], 0
        for p, share, on, dim in ranked:
            # what the gather fills: d slots (not the share: uneven shares differ by rank, the
            # buckets may not), in the dtype it sends
            nbytes = self._size(on) * slot_elements(p, self._size(on), dim) * self._sent(share).itemsize
            prev = buckets[-1]
            if prev and (size + nbytes > BUCKET_BYTES or share.dtype != prev[0][1].dtype or on != prev[0][2]):
                buckets.append([])
                size = 0
            buckets[-1].append((p, share, on, dim))
            size += nbytes
        return [b for b in buckets if b]

    @torch.no_grad()
    def step(self, closure=None):
        self.wait()  # a step with no forward since the last: its gathers land first
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p, share, on, dim in self._split:  # each share's gradient: its part of the reduced gradient
            if p.grad is None:
                share.grad = None
                continue
            g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            if g.shape != share._local_tensor.shape:  # whole (all-reduced), not reduce-scattered
                g = share_of(g, self._size(on), self._rank(on), dim)
            share.grad = DTensor.from_local(
                g, self.mesh, share.placements, run_check=False, shape=share.shape, stride=share.stride()
            )
        self.inner.step()
        for _, share, _, _ in self._split:
            share.grad = None
        self.rounded = any(self._sent(s) != s.dtype for _, s, _, _ in self._split)
        self._next = 0
        for _ in range(min(IN_FLIGHT, len(self._buckets))):
            self._start_next()
        if not self.overlap:
            self.wait()
        return loss

    def _start_next(self) -> None:
        """Start the next bucket's all-gather (asynchronous) and mark its parameters pending."""
        j, self._next = self._next, self._next + 1
        work, parts = self._gather(j, self._sent(self._buckets[j][0][1]), async_op=True)
        self._inflight.append((j, work, parts))
        for p, _, _, _ in self._buckets[j]:
            setattr(p, PENDING_ATTR, (self, j))

    def _gather(self, j: int, dtype: torch.dtype, async_op: bool):
        """Bucket ``j``'s all-gather of its shares sent in ``dtype``: (its work, the ``[d, n]``
        parts it fills). Over several axes, one gather per axis, the inner first (each
        concatenates its group's pieces in its coordinate's order, so the last holds all ``d`` in
        share order): the inner ones run here, the outer one as ``async_op`` says."""
        bucket = self._buckets[j]
        on = bucket[0][2]
        d = self._size(on)
        slots = [slot_elements(p, d, dim) for p, _, _, dim in bucket]
        # each share flattened (a contiguous copy where it is cut on another dim than 0)
        if all(s._local_tensor.numel() == n for (_, s, _, _), n in zip(bucket, slots)):
            parts = torch.cat([s._local_tensor.reshape(-1).to(dtype) for _, s, _, _ in bucket])
        else:  # uneven shares: each in a slot of ``c`` rows (share_rows), the rest padding
            parts = bucket[0][1]._local_tensor.new_zeros(sum(slots), dtype=dtype)
            off = 0
            for (_, s, _, _), n in zip(bucket, slots):
                parts[off : off + s._local_tensor.numel()].copy_(s._local_tensor.reshape(-1))
                off += n
        n = parts.numel()
        work = None
        for k, a in enumerate(reversed(on)):
            mine, parts = parts, parts.new_empty(self.mesh.size(a) * parts.numel())
            outer = k == len(on) - 1
            work = gather_into(parts, mine, group=self.mesh.get_group(a), async_op=outer and async_op)
        return work, parts.view(self._size(on), n)

    @torch.no_grad()
    def wait(self, upto: int | None = None) -> None:
        """Complete the all-gathers in flight, in bucket order, up to bucket ``upto`` (None: all of
        them, every bucket not started yet too): each waited for, the other ranks' parts copied
        into the parameters, and for each bucket completed the next one started (at most
        ``IN_FLIGHT`` in flight)."""
        last = len(self._buckets) - 1 if upto is None else upto
        while self._inflight and self._inflight[0][0] <= last:
            j, work, parts = self._inflight.pop(0)
            work.wait()
            self._place(j, parts)
            if self._next < len(self._buckets):
                self._start_next()

    def _place(self, j: int, parts: torch.Tensor) -> None:
        """Copy the other ranks' parts of bucket ``j``'s gather into the parameters (a half part
        upcast into the fp32 parameter) and clear their pending mark."""
        on = self._buckets[j][0][2]
        d, r = self._size(on), self._rank(on)
        off = 0
        for p, _, _, dim in self._buckets[j]:
            local = p._local_tensor
            for q in range(d):
                part = share_of(local, d, q, dim)
                if q != r and part.numel():
                    part.copy_(parts[q, off : off + part.numel()].view(part.shape))
            off += slot_elements(p, d, dim)
            setattr(p, PENDING_ATTR, None)

    @torch.no_grad()
    def exact(self) -> None:
        """Every rank's parameters exactly the owners' fp32 masters: the gathers in flight waited
        for, then, where the last step gathered half copies (``rounded``), each bucket gathered
        again in the parameters' own dtype (module docstring). Collective over the data axes: every
        rank calls it (``ParallelModule`` does, before any state is read); nothing where nothing is
        rounded."""
        self.wait()
        if not self.rounded:
            return
        for j, bucket in enumerate(self._buckets):
            _, parts = self._gather(j, bucket[0][1].dtype, async_op=False)
            self._place(j, parts)
        self.rounded = False

    @property
    def in_flight(self) -> int:
        """How many buckets' all-gathers are started and not yet waited for."""
        return len(self._inflight)

    def zero_grad(self, set_to_none: bool = True) -> None:
        clear_grads(self.params, set_to_none)
        self.inner.zero_grad(set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.exact()
        self.inner.load_state_dict(state_dict)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
