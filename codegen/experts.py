r"""Expert parallelism at run time: the experts of a mixture-of-experts layer split over a mesh axis.

Two forms, both computing ``torch.ops.autopar.moe_experts`` (``kernels/moe.py``) over mesh axis
``axis`` of ``n`` ranks, rank ``r`` (its coordinate on the axis) holding the contiguous block of
experts ``r E/n .. (r+1) E/n - 1`` (``E = num_experts``, divisible by ``n``):

``expert_parallel`` (tokens split over the axis): ``x``, ``weights``, ``ids`` are this rank's rows;
the result is this rank's rows of the layer's output. The dropless all-to-all dispatcher of
Megatron-Core's ``MoEAlltoAllTokenDispatcher`` and torchtitan's ``expert_parallel.py``:

1. ``route``: this rank's ``T_r k`` pairs sorted (stably) by expert, ``c[e]`` pairs for expert ``e``;
   their rows gathered in that order (in ``w_in``'s dtype, the matmuls').
2. counts first: ``c`` viewed ``[n, E/n]`` (block ``d`` for rank ``d``'s experts) is all-to-all'ed
   (equal splits), so each rank knows ``c_s[e]``, what source ``s`` sends each of its experts.
3. the rows, all-to-all'ed with split sizes ``sum_e c[e]`` per destination (send) and
   ``sum_e c_s[e]`` per source (receive). They arrive by source rank, then local expert, then token.
4. regrouped by local expert (a stable sort: within an expert by source, then token: the global
   token order when the axis splits the tokens in contiguous blocks), ``experts_mlp``, and put back
   in arrival order (the inverse permutation).
5. the all-to-all back (the splits swapped), then ``combine``: weighted, put back in pair order,
   summed over ``k`` in Hugging Face's order.

The all-to-all with split sizes is an autograd function whose backward is the all-to-all the other
way (the splits swapped), so the gradient of ``x`` and ``weights`` is this rank's rows' (Shard), and
the gradient of the rank's expert weights sums every rank's tokens routed to them: the gradient of
that slice of the experts (the gradient convention of ``codegen/collectives.py``: a Shard value's
gradient is its shard). Collectives over the axis: forward, one all-to-all of ``E`` int64 counts
and two of rows (dispatch, combine); backward, two of rows. Each all-to-all of rows sends
``T_r k H e`` bytes from rank ``r`` (``e`` the weights' element size; the rows that stay on the
rank included) and receives what the routing sends it: ``T k H e / n`` per rank when balanced.

Capacity (``capacity_factor``; ``None``: dropless). Each expert keeps at most
``C = ceil(capacity_factor * T k / E)`` pairs, ``T`` the tokens over the whole axis: the first
``C`` in global token order (rank 0's tokens first, each rank's in row order); the pairs beyond
get no output from that expert (their term of the weighted sum is 0: the token keeps only its
other experts' terms, and the residual connection around the layer carries it). ``T`` comes from
one more collective, an all-reduce of the ranks' token counts. The pairs are
still sent (the receiver, which sees every source's counts, decides), so the all-to-all's bytes do
not shrink; the experts' matmuls do.

``local_experts`` (tokens replicated over the axis): ``moe_experts`` on this rank's experts
(``first_expert = r E/n``), no collective: the output is this rank's summand of the layer's output
(Partial over the axis). Backward, each rank gets the gradient of its experts' slice whole, and
its own summand of the gradients of ``x`` and ``weights`` (its experts' terms), not their sum: as
for the vocabulary-parallel loss (``kernels/cross_entropy.py``), the caller's Megatron "f" on those
Replicate inputs (identity forward, all-reduce of the gradient) sums them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from autopar.codegen.collectives import axis_group, current_mesh
from autopar.kernels.moe import Act, MoeOperands, autocast_operands, combine, experts_mlp, moe_experts, route


def experts_per_rank(op: MoeOperands, n: int) -> int:
    """The experts each rank holds, checked against ``w_in``'s; the op is the whole layer's."""
    num_experts, w_in = op.num_experts, op.w_in
    if op.first_expert:
        raise ValueError(
            f"expert parallelism splits a whole layer's experts: this moe_experts holds experts from "
            f"{op.first_expert} on (first_expert=0 is the whole layer)"
        )
    if num_experts % n or w_in.shape[0] != num_experts // n:
        raise ValueError(
            f"expert parallelism over {n} ranks: each holds num_experts / {n} experts, {num_experts} / {n}; "
            f"this rank's w_in holds {w_in.shape[0]} (split the experts in {n} equal contiguous blocks)"
        )
    return num_experts // n


def _exchange(x: Tensor, send: list[int], recv: list[int], mesh: DeviceMesh, axis: int) -> Tensor:
    """Rows ``x`` cut in ``send[d]`` rows for each destination ``d``; returns the rows received,
    ``recv[s]`` from each source ``s``, in source order (one ``all_to_all_single``)."""
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(
        out, x, output_split_sizes=recv, input_split_sizes=send, group=axis_group(mesh, axis)
    )
    return out


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, axis, mesh):
        ctx.splits, ctx.axis, ctx.mesh = (send, recv), axis, mesh
        return _exchange(x, send, recv, mesh, axis)

    @staticmethod
    def backward(ctx, g):
        send, recv = ctx.splits
        return _exchange(g, recv, send, ctx.mesh, ctx.axis), None, None, None, None


def all_to_all_rows(x: Tensor, send: list[int], recv: list[int], axis: int, mesh: DeviceMesh) -> Tensor:
    """Autograd-aware ``_exchange``: the backward sends the gradient rows back the way they came."""
    return _AllToAllV.apply(x, send, recv, axis, mesh)


def capacity(capacity_factor: float, tokens: int, k: int, num_experts: int) -> int:
    """Pairs one expert keeps: ``ceil(capacity_factor * tokens * k / num_experts)``."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor}: a positive factor, or None for dropless")
    return math.ceil(capacity_factor * tokens * k / num_experts)


def _regroup(recv_counts: Tensor, cap: int | None) -> tuple[Tensor, Tensor]:
    """Received rows (``recv_counts`` ``[n, E_l]``: by source, then local expert) -> the indices of
    the rows kept, grouped by local expert (by source within one), and the kept count per expert."""
    n, local = recv_counts.shape
    device = recv_counts.device
    expert_of_row = torch.arange(local, device=device).repeat(n).repeat_interleave(recv_counts.reshape(-1))
    order = torch.sort(expert_of_row, stable=True).indices
    counts = recv_counts.sum(0)
    if cap is None:
        return order, counts
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(order.numel(), device=device) - starts.repeat_interleave(counts)
    return order[position < cap], counts.clamp(max=cap)


def expert_parallel(op: MoeOperands, axis: int, capacity_factor: float | None = None) -> Tensor:
    """This rank's rows of the layer's output, tokens dispatched to the experts' ranks and back by
    all-to-all over mesh axis ``axis`` (module docstring); ``op``: this rank's rows and experts."""
    act = Act.of(op.act)
    x, w_in, w_up, w_out = autocast_operands(op.x, op.w_in, op.w_up, op.w_out)
    mesh = current_mesh()
    n = mesh.size(axis)
    local = experts_per_rank(op, n)
    ids, num_experts = op.ids, op.num_experts
    tokens, k = ids.shape
    routing = route(ids, num_experts, 0, num_experts)
    rows = x[torch.div(routing.order, k, rounding_mode="floor")].to(w_in.dtype)

    counts = routing.counts.to(torch.int64).contiguous()
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=axis_group(mesh, axis))
    send = counts.view(n, local).sum(1).tolist()
    recv_counts = recv_counts.view(n, local)
    recv = recv_counts.sum(1).tolist()
    received = all_to_all_rows(rows, send, recv, axis, mesh)

    cap = None
    if capacity_factor is not None:
        total = torch.tensor([tokens], dtype=torch.int64, device=ids.device)
        dist.all_reduce(total, group=axis_group(mesh, axis))
        cap = capacity(capacity_factor, int(total), k, num_experts)
    kept, kept_counts = _regroup(recv_counts, cap)
    out = experts_mlp(received[kept], kept_counts, w_in, w_up, w_out, act, op.gated, op.transposed)
    back = out.new_zeros(received.shape[0], out.shape[1]).index_copy(0, kept, out)
    returned = all_to_all_rows(back, recv, send, axis, mesh)
    return combine(returned, routing.order, op.weights, x.dtype)


def local_experts(op: MoeOperands, axis: int) -> Tensor:
    """This rank's summand (Partial over ``axis``) of the layer's output: every token, this rank's
    block of the experts (``op``'s ``w_*``); no collective."""
    mesh = current_mesh()
    first = mesh.get_local_rank(axis) * experts_per_rank(op, mesh.size(axis))
    return moe_experts(*op._replace(act=Act.of(op.act).value, first_expert=first))
