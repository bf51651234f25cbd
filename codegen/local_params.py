"""Plain leaf tensors the generated forward computes on, sharing the storage of the module's
``DTensor`` parameters.

The module's parameters are ``DTensor``s carrying the plan's placements (what optimizers,
``clip_grad_norm_`` and checkpoints see); the generated graph computes on their local pieces
(``collectives.local``). Reading a piece through ``DTensor.to_local()`` costs, per parameter and
step, an autograd node, a ``DTensor`` gradient built in its backward and the accumulation of that
``DTensor`` into ``.grad`` (tens of microseconds of host time each step, the whole step of a small
model). As FSDP2 computes on plain unsharded parameters, each parameter here gets a ``LocalLeaf``:
a plain tensor that requires grad and shares the storage (and version counter) of the parameter's
local piece, so the optimizer's in-place updates of the parameter are the leaf's values. Backward
accumulates into the leaf; a post-accumulate-grad hook moves that gradient to the parameter's
``.grad`` at once, as a ``DTensor`` of the parameter's placements (set where ``.grad`` is None,
added in place otherwise, as autograd's accumulation does), and leaves the leaf's ``.grad`` None:
``p.grad`` is the only gradient a user or an optimizer reads or zeroes. ``codegen/grad_sync.py``
hooks both the parameter (its tensor and post-accumulate hooks) and the leaf (``LocalLeaf.set_sync``:
one call from the leaf's own post-accumulate hook, which may take the gradient to its bucket), so
its reductions see the gradient whichever of the two the forward read.

Under ZeRO 2 and 3 the parameters the graph reads are FSDP2's gathered ones, set on the modules
by FSDP2's pre-forward hook: each FSDP2 group's pre-hook after it gives those their leaves
(``codegen/zero.py:_gathered_leaves``), and the gradient moves to the gathered parameter's
``.grad``, which FSDP2 reduce-scatters.

A pipelined step (``codegen/pipeline.py``) sets ``hold`` while its schedule runs the
micro-batches' backwards: autograd sums their gradients on the leaf, and ``release`` moves the sum
once: the sum of the same gradients in the same order as moving each and adding it to a
``.grad`` that was None (the step sets aside a ``.grad`` that holds values while it runs).

``ParallelModule.forward`` calls ``refresh_leaves`` on its leaves before the graph runs: a leaf whose
parameter's piece was replaced (``p.data = ...``, a load that assigns) or whose ``requires_grad``
changed is rebuilt with its hooks, and ``active`` follows ``ParallelModule.local_leaves``. With
``local_leaves`` False (``AUTOPAR_LOCAL_LEAVES=0`` for every module) the graph reads
``to_local()`` as before: ``torch.autograd.grad(loss, pmodel.parameters())`` needs that, since the
parameters themselves are then in the graph. A re-run of the forward during backward (activation
checkpointing, ``codegen/blocks.py``) reads the same leaf the forward read: ``collectives.local``
finds it on the parameter (``LEAF_ATTR``), not in a binding of the forward call.

**Half copies under mixed precision** (``passes/precision.py:compute_param_dtype``). FSDP2's
``MixedPrecisionPolicy(param_dtype=half)`` makes ZeRO-2/3's forward read half parameters, so
embeddings and norms output half and the residual stream is half. Every other parameter (ZeRO-0/1,
pipeline stages, the parameters FSDP2 leaves alone) is marked (``mark_half``) and read through
``half_copy``: the parameter's piece (its leaf, or ``to_local``) cast to the half type, once per
forward call as FSDP2 casts once per gather, and once per step where a step runs several
micro-batches (``ParallelModule.step``, ``PipelinedModule.step``: ``hold_copies``), so a pipeline
stage casts once a step, not once a micro-batch. The copy is cached on the parameter
(``COPY_ATTR``) until ``drop_copies``; the gradient flows back through the cast into the fp32
leaf (autograd's ``ToCopyBackward`` upcasts it), reduced in fp32 as FSDP2's ``reduce_dtype``. A
recomputation in backward reads the cached copy where one is held, else casts anew without caching
(nothing then outlives the backward). Every ZeRO stage computes the same numerics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

# the attribute of a DTensor parameter that holds its LocalLeaf
LEAF_ATTR = "_autopar_local_leaf"
# the attribute of a parameter whose ZeRO-1 all-gather is in flight: (the optimizer, its bucket)
# (``codegen/zero_one.py``: the gathers run behind the next forward)
PENDING_ATTR = "_autopar_pending_gather"
# the attributes of a parameter the forward reads as a half copy: its half type (``mark_half``),
# and the copy of the current forward call or step (``half_copy``)
HALF_ATTR = "_autopar_half_dtype"
COPY_ATTR = "_autopar_half_copy"


def wait_param(p: torch.Tensor) -> None:
    """Before ``p`` is read: wait for its ZeRO-1 bucket's all-gather (and the buckets before it)
    where one is in flight (``codegen/zero_one.py``); nothing otherwise."""
    pending = getattr(p, PENDING_ATTR, None)
    if pending is not None:
        pending[0].wait(pending[1])


def wait_params(tensors: Iterable[torch.Tensor]) -> None:
    """``wait_param`` of each of ``tensors``: every ZeRO-1 gather in flight into them completes."""
    for t in tensors:
        wait_param(t)


def grad_like(p: DTensor, g: torch.Tensor) -> DTensor:
    """Local gradient ``g`` as a ``DTensor`` gradient of parameter ``p`` (no communication). Where
    ``g`` is laid out as ``p``'s local piece (autograd gives a leaf's gradient the leaf's layout; a
    bucket's slice viewed as the piece has it), the parameter's own spec (mesh, placements, global
    shape and stride) wraps it: the constructor ``DTensor.from_local`` ends in, without an autograd
    node or a spec rebuilt from the piece every step; else ``DTensor.from_local``."""
    piece = p._local_tensor
    if g.stride() == piece.stride() and g.shape == piece.shape and g.dtype == piece.dtype:
        # ``DTensor.__new__`` is the C++ constructor; ``DTensor.__init__`` does nothing but carry
        # the decorators that keep it out of dynamo and mark it for export (about 10 Python calls
        # a gradient, per parameter and step), so it is left out at run time
        return DTensor.__new__(DTensor, g, p._spec, requires_grad=False)
    return DTensor.from_local(g, p.device_mesh, p.placements, run_check=False)


def clear_grads(params, set_to_none: bool = True) -> None:
    """``torch.optim.Optimizer.zero_grad`` over ``params`` (an optimizer that steps other tensors
    than the module's parameters clears the parameters' gradients with it)."""
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            p.grad.detach_().zero_()


class LocalLeaf:
    """The plain leaf of one ``DTensor`` parameter (module docstring)."""

    def __init__(self, param: DTensor):
        self.param = param
        self.active = True
        # True: backward leaves its gradients on the leaf, summed there by autograd, until
        # ``release`` (a pipelined step's micro-batches: one move per step, not one per backward)
        self.hold = False
        # the gradient sync's (``set_sync``): called with the leaf's gradient before it moves, and
        # True where it took it (to its bucket, which sets ``.grad``); False: moved here, as usual
        self._sync: Callable[[torch.Tensor], bool] | None = None
        self._build()

    def _build(self) -> None:
        p = self.param
        self.src = p._local_tensor
        self.leaf = self.src.detach().requires_grad_(p.requires_grad)
        self.acc = None
        if self.leaf.requires_grad:
            # kept alive: the leaf holds its AccumulateGrad node only weakly
            self.acc = self.leaf.view_as(self.leaf).grad_fn.next_functions[0][0]
            self.leaf.register_post_accumulate_grad_hook(self._move)

    def set_sync(self, sync: Callable[[torch.Tensor], bool]) -> None:
        """``sync(gradient)`` is called each time the leaf's gradient would move to the parameter's
        ``.grad`` (one backward's, or ``release``'s sum), with the gradient, which the leaf no longer
        holds: True, it took it (and sees to ``.grad`` itself); False, the leaf moves it. One call a
        parameter and backward, from the leaf's one hook: the gradient sync's whole work per
        gradient (``codegen/grad_sync.py``), where a tensor hook and a second post-accumulate hook
        would each cost a Python call and their dispatch."""
        self._sync = sync

    def _move(self, leaf: torch.Tensor) -> None:
        if self.hold:  # accumulating over micro-batches: ``release`` moves the sum once
            return
        g, leaf.grad = leaf.grad, None
        if self._sync is not None and self._sync(g):
            return
        p = self.param
        if p.grad is None:
            p.grad = grad_like(p, g)
            return
        grad = p.grad
        local = grad._local_tensor if isinstance(grad, DTensor) else grad
        if local.shape == g.shape:
            local.add_(g)
        else:  # a gradient kept placed otherwise (ZeRO-1's reduce-scattered shares): DTensor adds
            grad.add_(grad_like(p, g))

    def release(self) -> None:
        """Stop holding (``hold``) and move what the leaf accumulated meanwhile to the parameter's
        ``.grad``, as one backward's ``_move`` would have."""
        self.hold = False
        if self.leaf.grad is not None:
            self._move(self.leaf)


def refresh_leaves(leaves: Iterable[LocalLeaf], active: bool) -> None:
    """Rebuild each of ``leaves`` where its parameter's piece or ``requires_grad`` changed;
    ``active``: whether the forward reads them (module docstring). One loop a forward
    (``ParallelModule.forward``, ``PipelinedModule.step``, FSDP2's pre-forward hook in
    ``codegen/zero.py``), not one call a parameter."""
    for h in leaves:
        h.active = active
        p, leaf = h.param, h.leaf
        src = p._local_tensor
        if (
            src is not h.src
            or leaf.requires_grad != p.requires_grad
            or leaf.data_ptr() != src.data_ptr()
            or leaf.shape != src.shape
        ):
            h._build()


def attach_leaves(params: Iterable[torch.nn.Parameter]) -> list[LocalLeaf]:
    """A ``LocalLeaf`` for every ``DTensor`` parameter among ``params`` (once each), set on the
    parameter as ``LEAF_ATTR``."""
    out, seen = [], set()
    for p in params:
        if isinstance(p, DTensor) and id(p) not in seen:
            seen.add(id(p))
            h = LocalLeaf(p)
            setattr(p, LEAF_ATTR, h)
            out.append(h)
    return out


def leaf_of(p: torch.Tensor) -> LocalLeaf | None:
    """The ``LocalLeaf`` of parameter ``p``, if it has one."""
    return getattr(p, LEAF_ATTR, None)


def mark_half(params: Iterable[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Mark the floating parameters among ``params`` of another dtype than ``dtype`` to be read as
    half copies (module docstring); returns them. ``dtype`` None (no mixed precision): none."""
    out, seen = [], set()
    if dtype is None:
        return out
    for p in params:
        if id(p) in seen or not p.is_floating_point() or p.dtype == dtype:
            continue
        seen.add(id(p))
        setattr(p, HALF_ATTR, dtype)
        out.append(p)
    return out


def half_copy(p: torch.Tensor, dtype: torch.dtype, piece: torch.Tensor) -> torch.Tensor:
    """The half copy of parameter ``p`` whose piece the forward reads is ``piece``: the cached one,
    else ``piece`` cast to ``dtype``, cached unless made in a backward (a recomputation)."""
    c = p.__dict__.get(COPY_ATTR)
    if c is not None:
        return c
    c = piece.to(dtype)
    if torch._C._current_graph_task_id() == -1:  # not inside a backward
        p.__dict__[COPY_ATTR] = c
    return c


def drop_copies(params: Iterable[torch.Tensor]) -> None:
    """Forget the cached half copies of ``params`` (autograd keeps what backward still needs)."""
    for p in params:
        p.__dict__.pop(COPY_ATTR, None)
