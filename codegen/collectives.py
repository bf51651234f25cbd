"""Autograd-aware collectives over one mesh axis, as the generated code calls them.

Gradient convention (the one ``cost_model/comm.py`` prices): the gradient of a Replicate or
Partial value is the full gradient on every rank; the gradient of a Shard value is the shard.
Under it, each function's backward is:

=================  ==========================  ======================================
function           forward                     backward
=================  ==========================  ======================================
all_gather         concat shards along dim     local slice (or reduce-scatter, fused)
chunk              local slice along dim       all-gather
all_reduce         sum (Partial -> Replicate)  identity
all_reduce_        the same, waited for where  identity
deferred           the caller reads it
reduce_scatter     sum + slice                 all-gather
to_partial         keep on coordinate 0        identity
f                  identity                    all-reduce (Megatron-LM's "f")
all_to_all         re-cut: split one dim,      the all-to-all the other way
                   concatenate another
all_gather_linear  all_gather, then linear     linear's backward, then all_gather's
linear_reduce_     linear, then                all_gather of the gradient, then linear's
scatter            reduce_scatter              backward
=================  ==========================  ======================================

The last two are collective matmuls (``kernels/collective_matmul.py``): the collective runs as
ring hops that overlap the matmul's chunks, forward and backward; ``all_gather_linears`` is the
first for several linears of one input, keeping the shard and gathering it again in backward.

Which mesh. The generated code names a mesh axis, never a process group or a mesh
(``all_gather(x, dim, axis)``), so one graph runs on whichever mesh its module was built with.
``ParallelModule.forward`` runs the graph inside ``with bound_mesh(self.mesh):``, which sets a
context variable for the duration of the call and restores the previous value afterwards (so
binds nest, e.g. one parallel module called inside another's forward, and nothing stays bound
after a call returns or raises). Each collective's forward reads the bound mesh once
(``current_mesh``), runs on its groups and stores it in its autograd ``ctx``; its backward runs
on ``ctx.mesh``. Backward therefore needs no binding and always uses the mesh its forward ran
on, whatever other modules, on other meshes, ran forward in between (two parallel modules on
different meshes in one process, forward of both and then one backward through both). A
collective called with no mesh bound raises ``DistributedSetupError``. Code outside the
generated graph that runs collectives (``codegen/grad_sync.py``'s hooks, ``gather_full``) takes
the mesh as an argument and never reads the binding.

Gloo lacks some collectives on some versions; where it does, reduce-scatter runs as all-reduce +
slice (priced the same way by the cost model's calibration).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.codegen.local_params import HALF_ATTR, LEAF_ATTR, PENDING_ATTR, half_copy
from autopar.errors import DistributedSetupError
from autopar.kernels import collective_matmul as K
from autopar.placement import is_partial, is_shard

# the mesh the generated code's collectives run on, set only inside ``bound_mesh``
_BOUND: ContextVar[DeviceMesh | None] = ContextVar("autopar_bound_mesh", default=None)


@contextmanager
def bound_mesh(mesh: DeviceMesh) -> Iterator[DeviceMesh]:
    """Run the generated code's collectives on ``mesh`` inside the ``with`` block; the binding
    in force before (none, or an outer block's mesh) is restored when the block ends."""
    token = _BOUND.set(mesh)
    try:
        yield mesh
    finally:
        _BOUND.reset(token)


def current_mesh() -> DeviceMesh:
    """The mesh bound by the innermost ``bound_mesh`` block; raises outside any."""
    mesh = _BOUND.get()
    if mesh is None:
        raise DistributedSetupError(
            "an autopar collective ran with no device mesh bound: call the module autopar.autoparallelize "
            "returned (its forward binds the mesh), not its .local graph directly; to run such a graph by "
            "hand, call it inside `with autopar.codegen.collectives.bound_mesh(mesh):`"
        )
    return mesh


def axis_group(mesh: DeviceMesh, axis: int) -> dist.ProcessGroup:
    """The process group of this rank along mesh axis ``axis``."""
    return mesh.get_group(axis)


# ``all_gather_single`` is ``all_gather_into_tensor``'s newer name (torch >= 2.13 warns on the old one)
gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# and ``reduce_scatter_single`` is ``reduce_scatter_tensor``'s
scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather(x: torch.Tensor, dim: int, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    x = x.contiguous()
    n = mesh.size(axis)
    if dim % x.dim() == 0:
        # the pieces are consecutive: gathered straight into the result. No list of parts, which
        # the backend's worker thread holds until it lets go of the work (on gloo, a race with the
        # caller: up to n L bytes more, for a while), and no copy into a concatenation
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        gather_into(out, x, group=axis_group(mesh, axis))
        return out
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=axis_group(mesh, axis))
    return torch.cat(parts, dim=dim)


def _slice(x: torch.Tensor, dim: int, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    # a copy even where the piece is contiguous (dim 0): a view would keep all of x alive with it
    piece = x.chunk(mesh.size(axis), dim=dim)[mesh.get_local_rank(axis)]
    return piece.clone(memory_format=torch.contiguous_format)


def reduce_sum(x: torch.Tensor, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    """A new tensor: the sum of ``x`` over the ranks of mesh axis ``axis`` (no autograd)."""
    x = x.contiguous().clone()
    dist.all_reduce(x, group=axis_group(mesh, axis))
    return x


def _reduce_scatter(x: torch.Tensor, dim: int, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    group = axis_group(mesh, axis)
    if dist.get_backend(group) == "nccl":
        x = x.movedim(dim, 0).contiguous()
        out = torch.empty((x.shape[0] // mesh.size(axis),) + x.shape[1:], dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, group=group)
        return out.movedim(0, dim).contiguous()
    return _slice(reduce_sum(x, mesh, axis), dim, mesh, axis)


# Each forward takes the mesh (read from the binding by the public function below), keeps it in
# ``ctx``, and its backward runs on ``ctx.mesh``: the mesh of the forward, never the binding.
class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis, fused_f, mesh):
        ctx.dim, ctx.axis, ctx.fused_f, ctx.mesh = dim, axis, fused_f, mesh
        return _gather(x, dim, mesh, axis)

    @staticmethod
    def backward(ctx, g):
        if ctx.fused_f:
            return _reduce_scatter(g, ctx.dim, ctx.mesh, ctx.axis), None, None, None, None
        return _slice(g, ctx.dim, ctx.mesh, ctx.axis), None, None, None, None


class _Chunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis, mesh):
        ctx.dim, ctx.axis, ctx.mesh = dim, axis, mesh
        return _slice(x, dim, mesh, axis)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.mesh, ctx.axis), None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, mesh):
        return reduce_sum(x, mesh, axis)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class DeferredSum(torch.Tensor):
    """The result of an all-reduce still in flight (``all_reduce_deferred``), waited for when an op
    first reads its values, as functional collectives' ``AsyncCollectiveTensor`` is, except that the
    ops that read only its shape, dtype and device (``ones_like``: the gradient ``loss.backward()``
    seeds backward with, and the other ``*_like`` factories) do not wait. So ``loss.backward()``
    runs while the loss is still being summed across ranks, and the sum is waited for where it is
    read (``loss.item()``, ``loss.detach()``, ``print(loss)``, any op on it; each returns plain
    tensors). Written here rather than on ``AsyncCollectiveTensor`` because that one waits on
    ``ones_like`` (so backward would start with the wait) and maps every op's arguments through
    pytree: about 420 Python calls a step for the few ops a training loop runs on its loss, where
    this one makes about 40 (``benchmarks/profile_vs_torch.py``).

    A sum may also be not started yet (``pending``: ``elem`` is this rank's own value, ``group``
    the group to sum it over, ``riding``): it then rides in the first gradient bucket backward
    all-reduces (``codegen/grad_sync.py``, "The loss rides"), which calls ``rode`` with its slot
    of the bucket and the bucket's work, so the sum costs no collective of its own. Where it is
    read before any bucket took it, or ``start`` is called (the next forward, the end of a
    backward that started no bucket), it is all-reduced on its own."""

    elem: torch.Tensor
    then: object
    value: torch.Tensor | None
    group: object
    work: object
    check: object
    __slots__ = ["elem", "then", "value", "group", "work", "check"]
    __torch_function__ = torch._C._disabled_torch_function_impl  # straight to dispatch, no Python

    @staticmethod
    def __new__(
        cls,
        elem: torch.Tensor,
        then=None,
        dtype: torch.dtype | None = None,
        group=None,
        check=None,
        shape=None,
    ):
        """``elem``: the all-reduce's output (or, with ``group``, this rank's value, not yet summed
        over ``group``; or another ``DeferredSum``, whose waited values ``then`` reads); ``then``: a
        function of the waited-for sum that gives the value (None: the sum itself), of ``elem``'s
        shape (or ``shape``) and of ``dtype``; ``check``: called before a read starts a pending sum
        on its own (``ParallelModule.check_calls``: every rank must read it so)."""
        if shape is None:
            size, strides, offset = elem.size(), elem.stride(), elem.storage_offset()
        else:  # a value of another shape than the sum (a mean of the summed ``[sum, count]``)
            size, strides, offset = torch.Size(shape), torch.empty(shape, device="meta").stride(), 0
        r = torch.Tensor._make_wrapper_subclass(
            cls, size, strides=strides, storage_offset=offset,
            dtype=dtype or elem.dtype, layout=elem.layout, device=elem.device, requires_grad=False,
        )  # fmt: skip
        r.elem, r.then, r.value, r.group, r.work, r.check = elem, then, None, group, None, check
        return r

    @property
    def completed(self) -> bool:
        """Whether the values were waited for already."""
        return self.value is not None

    @property
    def pending(self) -> bool:
        """Whether the sum is not started yet (it waits for a gradient bucket to ride in)."""
        return self.group is not None or (type(self.elem) is DeferredSum and self.elem.pending)

    def rode(self, slot: torch.Tensor, work) -> None:
        """The sum rides in a bucket: ``slot`` (``elem.numel()`` elements) is where the bucket's
        all-reduce, ``work``, leaves it."""
        self.elem, self.work, self.group = slot.view(self.elem.shape), work, None

    def start(self) -> None:
        """Start a pending sum on its own (a functional all-reduce); nothing for a started one."""
        if type(self.elem) is DeferredSum:  # the sum is the inner one's
            self.elem.start()
            return
        group = self.group
        if group is not None:
            self.group = None
            self.elem = torch.ops._c10d_functional.all_reduce(self.elem.contiguous(), "sum", group.group_name)

    def wait(self) -> torch.Tensor:
        """The values (waiting for the all-reduce the first time)."""
        if self.value is None:
            if type(self.elem) is DeferredSum:  # the inner sum, waited (or started) on its own
                total = self.elem.wait()
                self.value = total if self.then is None else self.then(total)
                return self.value
            if self.group is not None:  # read before backward: the sum, on its own
                if self.check is not None:
                    self.check()
                self.start()
            if self.work is not None:
                self.work.wait()
            else:
                torch.ops._c10d_functional.wait_tensor(self.elem)
            self.value = self.elem if self.then is None else self.then(self.elem)
        return self.value

    def _like(self) -> torch.Tensor:
        """A tensor of this one's metadata, for the ops that read nothing else."""
        if self.then is None:
            return self.elem
        return torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device=self.device)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"DeferredSum({self.wait()!r})"

    def tolist(self):
        return self.wait().tolist()

    def numpy(self, *args, **kwargs):  # type: ignore[override]
        return self.wait().numpy(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _SHAPE_ONLY:  # reads the metadata only: no wait
            return func(args[0]._like(), *args[1:], **(kwargs or {}))
        args = tuple(_waited(a) for a in args)
        kwargs = {k: _waited(v) for k, v in kwargs.items()} if kwargs else {}
        return func(*args, **kwargs)


# (the gradient sync, the read check) where a returned sum may ride in a bucket (``riding``)
RIDE: ContextVar[tuple | None] = ContextVar("autopar_loss_ride", default=None)


@contextmanager
def riding(sync, check=None) -> Iterator[None]:
    """Inside, a returned sum (``all_reduce_deferred``, ``mean_deferred``) of a value that requires
    gradient is left pending and handed to ``sync`` (``codegen/grad_sync.GradSync``: ``rides``,
    ``add_rider``), to ride in backward's first bucket reduced over its group, rather than started
    at once; ``check``: what a read before backward calls first (``DeferredSum``). ``sync`` None:
    no effect."""
    token = RIDE.set((sync, check) if sync is not None else None)
    try:
        yield
    finally:
        RIDE.reset(token)


def _rider(ride: tuple | None, x: torch.Tensor, group, then=None, dtype=None) -> DeferredSum | None:
    """A pending sum of ``x`` over ``group``, handed to the sync of ``ride`` (``riding``'s), or
    None: no ride, or none of its buckets is reduced over ``group`` alone."""
    if ride is None or not ride[0].rides(group):
        return None
    d = DeferredSum(x.detach(), then, dtype, group=group, check=ride[1])
    ride[0].add_rider(d)
    return d


def _waited(a):
    """An op's argument with every ``DeferredSum`` in it (or in a list or tuple of it) waited for."""
    if type(a) is DeferredSum:
        return a.wait()
    if isinstance(a, (list, tuple)) and any(type(x) is DeferredSum for x in a):
        return type(a)(x.wait() if type(x) is DeferredSum else x for x in a)
    return a


_SHAPE_ONLY = frozenset(
    (
        torch.ops.aten.ones_like.default,
        torch.ops.aten.zeros_like.default,
        torch.ops.aten.empty_like.default,
        torch.ops.aten.full_like.default,
    )
)


class _AllReduceDeferred(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, mesh, ride):
        group = axis_group(mesh, axis)
        rider = _rider(ride, x, group)
        ctx.sync = ride[0] if rider is not None else None
        if rider is not None:  # pending: rides in backward's first bucket (``riding``)
            return rider
        # the functional all-reduce: a new tensor, its work registered with it (waited for by
        # ``wait_tensor``, which ``DeferredSum`` calls when the values are first read)
        out = torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group.group_name)
        return DeferredSum(out)

    @staticmethod
    def backward(ctx, g):
        if ctx.sync is not None:  # the sum, if no bucket took it, is started where backward ends
            ctx.sync.queue_finish()
        return g, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis, mesh):
        ctx.dim, ctx.axis, ctx.mesh = dim, axis, mesh
        return _reduce_scatter(x, dim, mesh, axis)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.mesh, ctx.axis), None, None, None


def _all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    """Cut ``x`` in n pieces along ``split_dim``, send piece i to coordinate i, and concatenate the
    pieces received along ``cat_dim`` in coordinate order (one ``all_to_all_single``)."""
    n = mesh.size(axis)
    send = torch.stack(x.chunk(n, dim=split_dim)).contiguous()  # piece i at row i
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=axis_group(mesh, axis))
    return torch.cat(recv.unbind(0), dim=cat_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim, cat_dim, axis, mesh):
        ctx.dims, ctx.axis, ctx.mesh = (split_dim, cat_dim), axis, mesh
        return _all_to_all(x, split_dim, cat_dim, mesh, axis)

    @staticmethod
    def backward(ctx, g):
        split_dim, cat_dim = ctx.dims
        return _all_to_all(g, cat_dim, split_dim, ctx.mesh, ctx.axis), None, None, None, None


class _ToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, mesh):
        return x.clone() if mesh.get_local_rank(axis) == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, mesh):
        ctx.axis, ctx.mesh = axis, mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return reduce_sum(g, ctx.mesh, ctx.axis), None, None


def local(x: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a parameter or buffer: the module's state is ``DTensor``s carrying the
    plan's placements, the generated code computes on their local tensors: a parameter's plain
    leaf where it has an active one (``codegen/local_params.py``: its gradient is moved to the
    parameter's ``.grad``), else ``DTensor.to_local`` (the gradient flows back into the parameter
    as a ``DTensor`` of the same placements). A plain tensor (FSDP2's gathered parameter under
    torch without SPMD meshes) is its own piece. A ``DTensor`` that takes no gradient (a buffer:
    rotary frequencies, masks) is read as its local tensor itself: ``to_local`` would give a view
    of it through an autograd function, host work each call that carries nothing back. A
    parameter whose ZeRO-1 all-gather is still in flight (``codegen/zero_one.py``) is waited for
    first: this is where the gathers started after the optimizer step meet the next forward. Under
    mixed precision a parameter marked ``HALF_ATTR`` is read as its half copy (``half_copy``)."""
    pending = getattr(x, PENDING_ATTR, None)
    if pending is not None:
        pending[0].wait(pending[1])
    half = getattr(x, HALF_ATTR, None)
    if half is not None:  # mixed precision: the forward's half copy (codegen/local_params.py)
        return half_copy(x, half, _piece(x))
    return _piece(x)


def _piece(x: torch.Tensor) -> torch.Tensor:
    """``local``'s piece of ``x`` in its own dtype."""
    leaf = getattr(x, LEAF_ATTR, None)
    if leaf is not None and leaf.active:
        return leaf.leaf
    if isinstance(x, DTensor):
        return x.to_local() if x.requires_grad else x._local_tensor
    return x


def batch_slice(x: torch.Tensor, axis: int, rows: int) -> torch.Tensor:
    """This rank's rows of an input whose batch (dim 0, ``rows`` rows in the whole batch) the plan
    splits over mesh axis ``axis``: the whole batch, as every rank may pass it, is sliced
    (``chunk``); a slice of ``rows / n`` rows is taken to be this rank's already (the loader gave
    each data-parallel rank its own, ``ParallelModule.data_rank``)."""
    mesh = current_mesh()
    n = mesh.size(axis)
    if x.shape[0] == rows:
        # an input that carries no gradient (ids, labels, data): the slice alone, no autograd node
        return chunk(x, 0, axis) if x.requires_grad else _slice(x, 0, mesh, axis)
    if x.shape[0] * n == rows:
        return x
    raise ValueError(
        f"an input has {x.shape[0]} rows: the plan takes the whole batch ({rows} rows) or this rank's slice "
        f"({rows // n} rows) on every rank"
    )


def run_device() -> torch.device:
    """The device the bound mesh runs on: ``cuda:<current device>`` for a CUDA mesh, else the
    mesh's device type. The generated code calls it wherever the traced graph named a device
    (``arange(..., device=)``, ``to(device=)``), so the code names none: the device it was traced
    on (often the CPU, or the meta device) never reaches the rank's run."""
    kind = current_mesh().device_type
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def run_device_type() -> str:
    """``run_device().type``: what ``torch.autocast`` regions of the graph take."""
    return current_mesh().device_type


def coordinate(axis: int) -> int:
    """This rank's coordinate on mesh axis ``axis`` of the bound mesh (for local ops that depend on it)."""
    return current_mesh().get_local_rank(axis)


# The names the generated code calls (``codegen/lower.py`` emits them, ``autopar/tools/simulate.py``
# matches them by identity and argument position). Non-tensor inputs (e.g. integer masks) go
# through unchanged in backward.
def all_gather(x: torch.Tensor, dim: int, axis: int, fused_f: bool = False) -> torch.Tensor:
    return _AllGather.apply(x, dim, axis, fused_f, current_mesh())


def chunk(x: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
    return _Chunk.apply(x, dim, axis, current_mesh())


def all_reduce(x: torch.Tensor, axis: int) -> torch.Tensor:
    return _AllReduce.apply(x, axis, current_mesh())


def all_reduce_deferred(x: torch.Tensor, axis: int) -> torch.Tensor:
    """``all_reduce`` of a value the graph only returns (the model's loss, summed over the batch's
    ranks): started here, waited for where the caller first reads the values (``DeferredSum``),
    so the forward does not block on the other ranks' arriving (a sync point a
    ``DistributedDataParallel`` step, which returns each rank's own loss, does not have). Every
    rank issues it in the same place, whether or not it reads it."""
    return _AllReduceDeferred.apply(x, axis, current_mesh(), RIDE.get() if x.requires_grad else None)


# where the forward's loss divides the gradients by the whole batch's count after they are reduced
# (``mean_deferred``; ``ParallelModule.forward`` sets it): a one-item list holding the
# ``codegen/grad_sync.GradSync`` that reduces every gradient the loss reaches, which the forward
# may clear (to None) once it sees an output that backward could also reach
SCALE_AFTER: ContextVar[list | None] = ContextVar("autopar_scale_after", default=None)

# the sum the forward's one ``all_reduce_started`` would give, where the module knows it already
# (``ParallelModule.forward``: the labels' count of the whole batch, counted where every rank holds
# it, or by ``step``'s micro-batch weights, which summed it over the ranks once for the step)
KNOWN_SUM: ContextVar[torch.Tensor | None] = ContextVar("autopar_known_sum", default=None)


def all_reduce_started(x: torch.Tensor, axis: int) -> DeferredSum:
    """The sum of ``x`` (no gradient) over mesh axis ``axis``, started now and waited for where it
    is read: a value the graph needs later (the loss's token count, counted from the labels alone,
    ``codegen/module.py:defer_output_sums``). Where the module knows that sum already
    (``KNOWN_SUM``), it is that value, and no collective runs: every rank of the group knows it
    alike, so all of them skip it together."""
    known = KNOWN_SUM.get()
    if known is not None:
        value = known.to(device=x.device, dtype=x.dtype).reshape(x.shape)
        done = DeferredSum(value)
        done.value = value
        return done
    if SCALE_AFTER.get() is not None:  # summed with the loss's sum instead (``mean_deferred``)
        return x
    group = axis_group(current_mesh(), axis)
    return DeferredSum(torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group.group_name))


class _MeanDeferred(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pair, count, axis, mesh, dtype, ride, scale):
        (count,) = count  # in a tuple: no tensor argument of autograd's
        ctx.dtype = pair.dtype
        group = axis_group(mesh, axis)
        if isinstance(count, DeferredSum):  # the count's sum, started before the model ran
            ctx.count, ctx.scale, ctx.paired = count, None, False
            then = lambda t: (t / count.wait()).to(dtype)  # noqa: E731
            rider = _rider(ride, pair[0], group, then, dtype)
            ctx.sync = ride[0] if rider is not None else None
            if rider is not None:  # the sum rides in backward's first bucket (``riding``)
                return rider
            total = torch.ops._c10d_functional.all_reduce(pair[0].contiguous(), "sum", group.group_name)
            return DeferredSum(total, then, dtype)
        # this rank's count (``SCALE_AFTER``): ``[sum, count]`` summed together, in one collective
        inner = _rider(ride, pair, group)
        ctx.sync = ride[0] if inner is not None else None
        if inner is None:
            inner = DeferredSum(
                torch.ops._c10d_functional.all_reduce(pair.detach().contiguous(), "sum", group.group_name)
            )
        ctx.count, ctx.scale, ctx.paired = inner, scale, True
        return DeferredSum(inner, lambda t: (t[0] / t[1]).to(dtype), dtype, shape=())

    @staticmethod
    def backward(ctx, g):
        if ctx.sync is not None:
            ctx.sync.queue_finish()
        zero = torch.zeros((), dtype=ctx.dtype, device=g.device)
        sync = ctx.scale[0] if ctx.scale is not None else None
        if sync is not None:  # d loss / d sum = 1 / count, applied after the gradients are reduced
            factor = sync.divide_after(ctx.count)
            if factor is not None:
                return torch.stack([g.to(ctx.dtype) * factor, zero]), None, None, None, None, None, None
        c = ctx.count.wait()
        c = (c[1] if ctx.paired else c).to(ctx.dtype)  # the summed pair's count, or the count
        return torch.stack([g.to(ctx.dtype) / c, zero]), None, None, None, None, None, None


def mean_deferred(pair: torch.Tensor, count, axis: int, dtype: torch.dtype) -> torch.Tensor:
    """``mean_of_sum_and_count(all_reduce(pair, axis), dtype)`` (a token-mean loss from this rank's
    ``[sum, count]``), where the count's sum over ``axis`` was started already
    (``all_reduce_started``): the sum's all-reduce is started here and waited for where the loss is
    read (``DeferredSum``); backward needs only the count (d loss / d sum = 1 / count), so neither
    forward nor backward waits for the other ranks' losses.

    Where ``count`` is this rank's own (``SCALE_AFTER``: the gradients this loss reaches are all
    reduced in buckets), the count is summed with the sum, one all-reduce of ``[sum, count]``, and
    backward runs on the sum (d loss / d sum = 1): the reduced gradients are divided by the count
    where backward ends (``GradSync.divide_after``), as Megatron-LM's ``calculate_per_token_loss``
    divides its reduced gradients by the summed token count. A backward that cannot divide so (the
    sync off, gradients accumulated unreduced) waits for the pair and divides here."""
    return _MeanDeferred.apply(
        pair, (count,), axis, current_mesh(), dtype, RIDE.get() if pair.requires_grad else None,
        SCALE_AFTER.get() if pair.requires_grad and not isinstance(count, DeferredSum) else None,
    )  # fmt: skip


def is_paired_mean(t) -> bool:
    """Whether ``t`` is a token-mean loss ``mean_deferred`` returned from its summed ``[sum, count]``
    (``SCALE_AFTER``): the one output whose backward the gradient buckets divide by the count."""
    return type(t) is DeferredSum and type(t.elem) is DeferredSum


def wait_deferred(outs) -> None:
    """Wait for the ``DeferredSum`` among ``outs`` (a no-op for those read already)."""
    for t in outs:
        if isinstance(t, DeferredSum):
            t.start()  # every rank starts it here (no read's ``check``)
            t.wait()


def reduce_scatter(x: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
    return _ReduceScatter.apply(x, dim, axis, current_mesh())


def to_partial(x: torch.Tensor, axis: int) -> torch.Tensor:
    return _ToPartial.apply(x, axis, current_mesh())


def all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, axis: int) -> torch.Tensor:
    """A value cut along ``cat_dim`` becomes cut along ``split_dim`` (Ulysses' sequence -> heads);
    backward is the all-to-all the other way."""
    return _AllToAll.apply(x, split_dim, cat_dim, axis, current_mesh())


def f(x: torch.Tensor, axis: int) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward."""
    return _F.apply(x, axis, current_mesh())


def vocab_parallel_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    chunk_rows: int,
    axes: tuple[int, ...],
) -> torch.Tensor:
    """The output projection fused with its loss, the vocabulary (``weight``'s rows) split over
    ``axes`` (in mesh-axis order, the first outermost, as DTensor nests shards):
    ``kernels/cross_entropy.py``'s vocabulary-parallel form, on those axes' groups. ``h`` and
    ``target`` are whole on ``axes``; the loss comes out whole, and ``h``'s gradient summed."""
    from autopar.kernels.cross_entropy import autocast_operands, vocab_parallel_linear_cross_entropy

    h, weight = autocast_operands(h, weight)  # both matmuls in the half type under autocast
    mesh = current_mesh()
    piece = 0
    for a in axes:
        piece = piece * mesh.size(a) + mesh.get_local_rank(a)
    groups = [axis_group(mesh, a) for a in axes]
    return vocab_parallel_linear_cross_entropy(
        h, weight, target, piece * weight.shape[0], groups if len(groups) > 1 else groups[0],
        ignore_index, reduction, chunk_rows,
    )  # fmt: skip


def all_gather_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dim: int,
    axis: int,
    fused_f: bool = True,
    keep_gathered: bool = False,
    regather: bool = False,
):
    """``all_gather(x, dim, axis, fused_f)`` then ``aten.linear`` with ``weight`` and ``bias``, as
    one collective matmul (``kernels/collective_matmul.py``): its ring's hops overlap the matmul's
    chunks, forward and (``fused_f``: the gathered input's gradient reduce-scattered) backward.
    ``keep_gathered``: also returns the gathered input, for the other uses of that gather.
    ``regather``: keeps only ``x`` for backward and gathers it again there. Runs on the bound
    mesh's group of ``axis``, which the kernel keeps for backward."""
    group = axis_group(current_mesh(), axis)
    return K.all_gather_linear(x, weight, bias, dim, group, fused_f, keep_gathered, regather)


def all_gather_linears(
    x: torch.Tensor, weights: list, biases: list | None, dim: int, axis: int, fused_f: bool = True
):
    """``all_gather_linear`` of several linears that take one gathered input (Q, K and V), as one
    collective matmul (``kernels/collective_matmul.py:all_gather_linears``) that keeps only ``x``
    for backward and gathers it again there: a tuple of their outputs."""
    group = axis_group(current_mesh(), axis)
    return K.all_gather_linears(x, weights, biases, dim, group, fused_f, regather=True)


def linear_reduce_scatter(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dim: int, axis: int
) -> torch.Tensor:
    """``aten.linear`` then ``reduce_scatter(..., dim, axis)`` of its partial sums, as one collective
    matmul (``kernels/collective_matmul.py``): each chunk's reduction travels while the next
    computes; backward all-gathers the gradient the same way. On the bound mesh's group of
    ``axis``, kept for backward."""
    return K.linear_reduce_scatter(x, weight, bias, dim, axis_group(current_mesh(), axis))


@torch.no_grad()
def gather_full(x: torch.Tensor, spec, mesh: DeviceMesh) -> torch.Tensor:
    """Rebuild the full tensor from this rank's piece under ``spec`` on ``mesh`` (no autograd):
    for checkpoints and comparison; collective on every rank of ``mesh``."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"gather_full takes the DeviceMesh the piece lives on (e.g. pmodel.mesh), got {mesh!r}"
        )
    for a, p in enumerate(spec):
        if mesh.size(a) == 1:
            continue
        if is_shard(p):
            x = _gather(x, p.dim, mesh, a)
        elif is_partial(p):
            x = reduce_sum(x, mesh, a)
    return x
