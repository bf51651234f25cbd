"""Which parameter gradients are synchronized after backward accumulates them (DDP-style), not inline.

Under data parallelism a replicated weight used by a batch-split op gets Megatron's "f" on its
input edge: identity forward, all-reduce of the gradient backward (``passes/costs.py:f_axes``).
Issued inline, that all-reduce blocks backward until it completes. Because it is linear and every
rank applies the same local ops, it commutes with summing the parameter's uses: when *every*
gradient-carrying use of a parameter needs the pure "f" on the same mesh axes ``D``,

    sum_c AR_D(g_c) = AR_D(sum_c g_c),

so codegen drops the per-use "f" and all-reduces the accumulated gradient once, asynchronously,
as soon as autograd has accumulated it (``codegen/grad_sync.py``); backward compute then runs
while the reduction is in flight. The cost model prices the overlap on a timeline
(``cost_model/overlap.py``).

A pure "f" on axis ``a`` is one where the stored placement already equals the use's (Replicate).
Where the stored piece is a shard, the "f" fuses into the all-gather's backward reduce-scatter
(``codegen/lower.py:emit_reshard``) and stays inline; so do parameters whose uses disagree on ``D``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch.fx as fx

from autopar.cost_model.comm import Collective, CommModel
from autopar.cost_model.compute import BACKWARD_FACTOR
from autopar.cost_model.overlap import hidden_seconds
from autopar.passes.costs import f_axes, resolve_source
from autopar.passes.rules import tensor_inputs
from autopar.passes.strategies import Strategy
from autopar.passes.trace import Role, TracedGraph
from autopar.placement import volume_factor


def pure_f_axes(stored, s: Strategy, k: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Axes of input ``k`` of a use under ``s`` where the "f" runs alone (not fused into a gather)."""
    return tuple(a for a in f_axes(s, k) if mesh_shape[a] > 1 and stored[a] == s.ins[k][a])


def inline_f_axes(s: Strategy, k: int, deferred: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The "f" axes of input ``k`` under ``s`` that run inline: all but the ``deferred`` ones of
    the parameter feeding it (codegen emits these; the cost model prices these)."""
    return tuple(a for a in f_axes(s, k) if a not in deferred)


def deferred_all_reduce_s(
    infos: dict, choice: dict[str, Strategy], comm: CommModel, p: str, axes: tuple[int, ...]
) -> tuple[float, float]:
    """Seconds of parameter ``p``'s gradient all-reduce over ``axes``: issued on an idle stream,
    and issued behind another still in flight (only the first axis's runs queued; the others
    follow it when backward ends)."""
    nbytes = infos[p].out_bytes / volume_factor(choice[p].out, comm.mesh_shape)
    first = comm.time(Collective.ALL_REDUCE, nbytes, axes[0])
    rest = sum(comm.time(Collective.ALL_REDUCE, nbytes, a) for a in axes[1:])
    return first + rest, comm.queued_all_reduce_time(nbytes, axes[0]) + rest


def deferred_grad_axes(
    tg: TracedGraph, choice: dict[str, Strategy], mesh_shape: Sequence[int]
) -> dict[str, tuple[int, ...]]:
    """Parameter placeholder name -> mesh axes its accumulated gradient is all-reduced over after
    backward produces it; parameters not listed keep their "f" inline."""
    params = {p.name for p in tg.placeholders if p.role is Role.PARAM}
    out: dict[str, tuple[int, ...]] = {}
    for node in tg.graph.nodes:
        if node.name not in params or not _needs_grad(node):
            continue
        stored = choice[node.name].out
        sets = set()
        for user in node.users:
            if user.op != "call_function":
                sets.add(())  # the output or an unknown consumer: never defer
                continue
            s = choice[user.name]
            for k, inp in enumerate(tensor_inputs(user)):
                if inp is node:
                    sets.add(pure_f_axes(stored, s, k, mesh_shape))
        if len(sets) == 1:
            (axes,) = sets
            if axes:
                out[node.name] = axes
    return out


def _needs_grad(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return getattr(val, "requires_grad", False) and val.dtype.is_floating_point


@dataclass(frozen=True)
class GradSyncCost:
    """What overlapping the deferred gradient all-reduces changes in a plan's step time [s].

    The cost tables price each use's "f" inline (``inline_f_s`` in all); what runs is one
    all-reduce per deferred parameter (``allreduce_s`` in all), of which ``hidden_s`` runs behind
    backward compute (``cost_model/overlap.py``). The step time is the tables' total plus
    ``adjustment_s``."""

    deferred: dict[str, tuple[int, ...]]
    inline_f_s: float
    allreduce_s: float
    hidden_s: float

    @property
    def adjustment_s(self) -> float:
        return self.allreduce_s - self.inline_f_s - self.hidden_s


def price_grad_sync(
    tg: TracedGraph,
    infos: dict,
    choice: dict[str, Strategy],
    compute_s: dict[str, float],
    comm: CommModel,
    efficiency: float,
) -> GradSyncCost:
    """Price the deferred all-reduces of a plan on the backward timeline.

    Backward runs the graph's ops in reverse; op ``v``'s step on the compute stream is the
    backward share of its compute (``BACKWARD_FACTOR / (1 + BACKWARD_FACTOR)`` of ``compute_s[v]``,
    the op's forward + backward seconds) and half of the collectives on its input edges as they
    run (a forward collective's backward is its transpose, of the same size). A deferred
    parameter's all-reduce is issued after the step of its first use in graph order, the last of
    its uses that backward reaches."""
    mesh = comm.mesh_shape
    deferred = deferred_grad_axes(tg, choice, mesh)
    bwd_share = BACKWARD_FACTOR / (1 + BACKWARD_FACTOR)
    steps: list[tuple[float, list[float]]] = []
    first_use: dict[str, int] = {}  # deferred parameter -> index of its first use's step
    inline_f = 0.0
    for node in tg.graph.nodes:
        if node.op != "call_function" or node.name not in choice or node.target is operator.getitem:
            continue
        s = choice[node.name]
        t_comm = 0.0
        for k, inp in enumerate(tensor_inputs(node)):
            src = resolve_source(inp)
            if src.name not in choice:
                continue
            info = infos[inp.name]
            have = choice[src.name].out
            full, _ = comm.reshard(have, s.ins[k], info.out_bytes, info.requires_grad, f_axes(s, k))
            if src.name in deferred:
                first_use.setdefault(src.name, len(steps))
                kept = inline_f_axes(s, k, deferred[src.name])
                run, _ = comm.reshard(have, s.ins[k], info.out_bytes, info.requires_grad, kept)
                inline_f += full - run
                full = run
            t_comm += full * (0.5 if info.requires_grad else 0.0)
        rg = infos[node.name].requires_grad
        steps.append((compute_s.get(node.name, 0.0) * (bwd_share if rg else 0.0) + t_comm, []))
    allreduce = 0.0
    for p, axes in deferred.items():
        t, t_q = deferred_all_reduce_s(infos, choice, comm, p, axes)
        allreduce += t
        steps[first_use[p]][1].append((t, t_q))
    hidden = hidden_seconds(list(reversed(steps)), efficiency)
    return GradSyncCost(deferred, inline_f, allreduce, hidden)
