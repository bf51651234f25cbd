"""When a linear and the collective beside it run as one collective matmul, and what that saves.

``kernels/collective_matmul.py`` runs an all-gather feeding a linear, or a linear feeding a
reduce-scatter, as a ring whose hops overlap the matmul's chunks. Codegen
(``codegen/lower.py``) emits them and the cost tables (``passes/costs.py``) price them; both ask
this module whether a use fuses (``fused_steps``), so they agree. A use is one tensor input ``k``
of an op ``user``, taking tensor ``inp`` through the steps of its reshard plan
(``autopar/reshard.py:reshard_plan``, what codegen emits and the comm model prices):

* **gather** (``Fusion.GATHER``, ``all_gather_linear``): ``user`` is ``aten.linear`` and ``k`` its
  input (0); the plan's *last* step is an all-gather along a dim other than the input's last (the
  contracted one); the steps before it run as they are. Not for a parameter or buffer taken as
  the input (codegen reads those through their own path), nor for a linear whose output is
  ``Partial`` (a linear runs one collective matmul: such an output may take the scatter). Codegen fuses at the use that runs the
  reshard (the first of the uses that share it, ``passes/grad_sync.py:reshard_key``), and hands
  the gathered input to the others; the tables price every use as if it ran it, and the plan's
  pricing takes the duplicates back out (``shared_reshards_s``), so what remains is the price of
  the one use that runs it, fused or not (``fused_steps`` decides both).
* **scatter** (``Fusion.SCATTER``, ``linear_reduce_scatter``): ``inp`` is the output of an
  ``aten.linear``, its only use is this one (``sole_use``: one op takes it, once; not the graph's
  output), and the plan's *first* step is a reduce-scatter (its output is ``Partial`` on that
  axis); the steps after it run as they are, from the fused op's output.

Both may hold at one use (a row-parallel linear's output gathered into a column-parallel one on
another axis): both fuse.

Price (``overlap_saving_s``): the fused step's collectives are priced as unfused
(``CommModel.time``, the same calls ``CommModel.reshard`` sums) less what the linear's matmul
hides of them (``cost_model/overlap.py:ring_hidden_s``): in forward against the linear's forward
compute, in backward (when the tensor needs a gradient and the step has a backward collective)
against its backward compute, the linear's tabled compute ``t`` (forward + backward, per rank)
split as ``cost_model/compute.py`` splits an op with two new gradients:

    forward  = t / (1 + BACKWARD_FACTOR),   backward = t * BACKWARD_FACTOR / (1 + BACKWARD_FACTOR)  [s]
    saving   = ring_hidden_s(T_fwd, forward, n, e) + ring_hidden_s(T_bwd, backward, n, e)           [s]

with ``T`` each collective's seconds on the step's axis of ``n`` ranks and ``e`` the device's
``comm_overlap``. The use's price is its unfused price less the saving.

**Re-gather** (``regathers``: a gather into a linear where every use of the tensor is a linear
taking it as input, the input needing a gradient; the uses that share the gather run as one
``all_gather_linears``, ``codegen/lower.py``): forward keeps the shard, ``1/n`` of the gathered
bytes (the edge's kept copy, ``passes/costs.py``; uses that share a reshard keep one copy,
``passes/memory_row.py``), and backward gathers it again (``kernels/collective_matmul.py``): a
ring hidden behind the weights' gradient chunks, the reduce-scatter's behind the input's, each half
of the backward (per use, against its own linear's compute: the shared gather is priced on the
first use, so the stacked matmul's ring, which hides behind all of them, is priced conservatively):

    saving = ring_hidden_s(T_fwd, forward) + ring_hidden_s(T_rs, backward / 2)
             - (T_ag - ring_hidden_s(T_ag, backward / 2))                                        [s]

the last term the re-gather's exposed seconds (``FusedStep.extra_calls``: the plan lists it).
Always on where it applies, not a search choice: it trades those seconds (none where the weight
gradient outlasts the gather, as with TP8 on NVLink at the published rows' sizes) for ``(n - 1) / n``
of the gathered input's bytes, which the trades ladder turns into less recomputation.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.cost_model.comm import CommModel
from autopar.cost_model.compute import BACKWARD_FACTOR
from autopar.cost_model.overlap import ring_hidden_s
from autopar.passes.rules import tensor_inputs
from autopar.placement import Spec, is_partial
from autopar.reshard import CollectiveCall, Phase, ReshardStep, StepKind

LINEAR = torch.ops.aten.linear.default


class Fusion(enum.Enum):
    """Which collective matmul a use runs (named as ``codegen/collectives.py`` calls it)."""

    GATHER = "all_gather_linear"
    SCATTER = "linear_reduce_scatter"


@dataclass(frozen=True)
class FusedStep:
    """One reshard step a collective matmul runs: ``step`` (its last for a gather, its first for
    a scatter), fused with the linear ``linear`` (the use's op, or the tensor's producer)."""

    kind: Fusion
    step: ReshardStep
    linear: fx.Node
    regather: bool = False  # a gather whose backward gathers the kept shard again (``regathers``)

    def __post_init__(self) -> None:
        want = StepKind.ALL_GATHER if self.kind is Fusion.GATHER else StepKind.REDUCE_SCATTER
        if self.step.kind is not want or self.linear.target is not LINEAR:
            raise ValueError(f"a {self.kind.value} fuses an {want.value} step with aten.linear, got {self}")
        if self.regather and self.kind is not Fusion.GATHER:
            raise ValueError(f"only a gather re-gathers in backward, got {self}")

    def extra_calls(self, requires_grad: bool) -> tuple[CollectiveCall, ...]:
        """Collectives it runs beyond its step's: a re-gather's backward all-gather."""
        if not (self.regather and requires_grad):
            return ()
        fwd = self.step.forward
        return (CollectiveCall(fwd.kind, fwd.axis, fwd.nbytes, Phase.BACKWARD),)


def regathers(user: fx.Node, k: int, inp: fx.Node) -> bool:
    """Does the gather fused into input ``k`` of ``user`` keep only the shard and gather again in
    backward (``kernels/collective_matmul.py``, "Backward re-gathers")? Where every use of the
    tensor is a linear taking it as its input (Q, K and V of one norm): codegen runs each alone,
    or those that share a gather as one collective matmul over their stacked weights
    (``codegen/lower.py``, Megatron's fused QKV); another use would read the gathered input and
    keep it for its own backward, so the shard alone would save nothing."""
    if k != 0 or not inp.users:
        return False
    return all(
        u.op == "call_function"
        and u.target is LINEAR
        and [a is inp for a in tensor_inputs(u)] == [True] + [False] * (len(tensor_inputs(u)) - 1)
        for u in inp.users
    )


def sole_use(node: fx.Node) -> tuple[fx.Node, int] | None:
    """``(user, k)`` where ``node``'s only use is tensor input ``k`` of op ``user``; None where it
    has several users, none, one that takes it twice, or the graph's output."""
    users = list(node.users)
    if len(users) != 1 or users[0].op != "call_function" or users[0].target is operator.getitem:
        return None
    ks = [k for k, a in enumerate(tensor_inputs(users[0])) if a is node]
    return (users[0], ks[0]) if len(ks) == 1 else None


def gather_step(
    user: fx.Node, k: int, steps: Sequence[ReshardStep], out: Spec, state: bool = False
) -> ReshardStep | None:
    """The all-gather ``all_gather_linear`` runs for input ``k`` of ``user`` (module docstring), or
    None. ``out``: ``user``'s output placement; ``state``: the tensor is a parameter or buffer."""
    if state or user.op != "call_function" or user.target is not LINEAR or k != 0 or not steps:
        return None
    if any(is_partial(p) for p in out):  # its output may be reduce-scattered instead: one of the two
        return None
    last = steps[-1]
    ndim = user.args[0].meta["val"].dim()
    if last.kind is not StepKind.ALL_GATHER or last.dim is None or last.dim % ndim == ndim - 1:
        return None
    return last


def scatter_step(inp: fx.Node, user: fx.Node, k: int, steps: Sequence[ReshardStep]) -> ReshardStep | None:
    """The reduce-scatter ``linear_reduce_scatter`` runs after ``inp`` for its use ``k`` by
    ``user`` (module docstring), or None."""
    if inp.op != "call_function" or inp.target is not LINEAR or not steps:
        return None
    if steps[0].kind is not StepKind.REDUCE_SCATTER or sole_use(inp) != (user, k):
        return None
    return steps[0]


def fused_steps(
    user: fx.Node,
    k: int,
    inp: fx.Node,
    steps: Sequence[ReshardStep],
    user_out: Spec,
    state: bool = False,
    grid: tuple[bool, bool] = (False, False),
) -> tuple[FusedStep, ...]:
    """The collective matmuls of the use ``k`` of ``user`` (whose output is placed ``user_out``)
    taking ``inp`` through ``steps``. ``grid``: whether ``inp``'s producer, and ``user``, run as
    2D linears (``autopar/lowerings/matmul_nd.py``), which gather inside and fuse nothing."""
    out = []
    s = None if grid[0] else scatter_step(inp, user, k, steps)
    if s is not None:
        out.append(FusedStep(Fusion.SCATTER, s, inp))
    g = None if grid[1] else gather_step(user, k, steps, user_out, state)
    if g is not None and g is not s:
        out.append(FusedStep(Fusion.GATHER, g, user, regathers(user, k, inp)))
    return tuple(out)


def overlap_saving_s(
    comm: CommModel, fused: Sequence[FusedStep], matmul_s: Callable[[fx.Node], float], requires_grad: bool
) -> float:
    """Seconds the collective matmuls ``fused`` hide of their steps' collectives (module
    docstring); ``matmul_s(linear)``: the linear's compute, forward + backward per rank, as the
    tables price it under the strategy in question."""
    share = 1.0 / (1.0 + BACKWARD_FACTOR)
    efficiency = comm.cluster.device.comm_overlap
    total = 0.0
    for f in fused:
        t = matmul_s(f.linear)
        a = f.step.axis
        n = comm.mesh_shape[a]
        backward = t * (1.0 - share)
        calls = [(f.step.forward, t * share)]
        extra = f.extra_calls(requires_grad)
        if requires_grad:  # a re-gather's two rings split the backward: weight's, then input's gradient
            calls.append((f.step.backward, backward / 2 if extra else backward))
        for call, compute in calls:
            if call is not None:
                total += ring_hidden_s(comm.time(call.kind, call.nbytes, a), compute, n, efficiency)
        for call in extra:  # the re-gather runs beyond the step's collectives: its exposed part costs
            seconds = comm.time(call.kind, call.nbytes, a)
            total -= seconds - ring_hidden_s(seconds, backward / 2, n, efficiency)
    return total
