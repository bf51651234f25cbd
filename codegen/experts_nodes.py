r"""Expert parallelism over an axis that spans nodes: each token crosses the inter-node link once per
node that holds any of its experts (DeepEP's normal-mode dispatch and combine, as Megatron-Core's
``MoEFlexTokenDispatcher`` runs it), instead of once per (token, expert) pair as the flat
all-to-all of ``codegen/experts.py:expert_parallel`` sends it.

Layout. Mesh axis ``axis`` of ``n`` ranks, ``m`` of them in each node: coordinates ``q m .. q m +
m - 1`` are node ``q`` (``N = n / m`` nodes; ranks are numbered node by node and an axis's group
is a run of consecutive ranks, ``cost_model/comm.py:node_split``: on CPU/gloo ranks the "nodes"
are these runs). Coordinate ``r = q m + l`` (``l`` its local index) holds experts ``r E/n .. (r+1)
E/n - 1``, as the flat form does, so node ``q`` holds ``q E/N .. (q+1) E/N - 1``. Two groups of
the axis: the *rail* of ``r``, the ``N`` coordinates ``q' m + l`` with its local index (one per
node, joined by the inter-node network: a rail-aligned all-to-all), and its *node*, the ``m``
coordinates ``q m + l'`` (joined by NVLink).

One dispatch level (``_dedup``): a group of ``G`` members, each holding the experts of one block
(``B = E / G`` consecutive experts). For each token ``t`` with destination blocks ``D_t = {ids[t,
j] // B}``:

1. counts first: the copies for each member (``|{t : d in D_t}|``), one all-to-all of ``G`` int64;
2. one copy of ``x[t]``, of ``weights[t]`` and of ``ids[t]`` to each member ``d in D_t``, ordered
   by member, then token (three all-to-alls: rows, weights, ids);
3. each member computes, for each copy it received, the *partial* sum over the pairs of the copy
   whose experts it holds, ``p_d[t] = sum_{j : ids[t,j] in block d} weights[t,j] expert(x[t])``
   (the level below, or at the bottom ``local_pairs``: the experts' grouped MLPs on the rows of
   the rank's own pairs only, a pair outside its experts contributing nothing);
4. the partials back, one row per copy (one all-to-all), summed at home over ``d in D_t`` in
   increasing ``d``: ``out[t] = (..(p_{d_0}[t] + p_{d_1}[t]) + ..)``, starting from zeros.

The hierarchical dispatch is two levels: the rail (``G = N``, a block a node's experts), whose
step 3 is the node level (``G = m``, a block one rank's experts) on the copies that arrived,
whose step 3 is ``local_pairs`` on the rank's experts. So a token crosses the inter-node link
once per destination node and fans out over NVLink once per destination rank inside it; its
result is summed inside the destination rank over its pairs there, inside the destination node
over its ranks, and at home over its nodes.

Summation order (fixed): ``out[t] = sum_q^{asc} (sum_l^{asc} (sum_j^{asc} w_{tj} y_{tj}))``, each
sum sequential from zeros, over the destination nodes ``q``, their ranks ``l`` and the token's pairs on
that rank; the single-device op sums over ``j`` alone, so the two agree up to the rounding of a
reordered sum (tests scale their tolerance with the values). Each step of the forward sums a
fixed number of terms in a fixed order; nothing depends on the arrival of messages.

Autograd: every all-to-all of rows or weights is ``codegen/experts.py:all_to_all_rows``, whose
backward sends the gradient back the way the rows came; counts and ids carry none. Gradients:
``x``'s and ``weights``' rows of this rank, the gradient of this rank's slice of the experts'
weights (every token routed to them), as the flat form gives. Dropless (no capacity). Rows
travel in the experts' matmuls' dtype (``autocast_operands``), the partials too.

Collectives per level and direction, in this order: counts (``G`` int64), rows (``copies x H``
in the op dtype), weights (``copies x k`` in the weights' dtype), ids (``copies x k`` int64), then
the partials back (``copies x H``); backward: the partials' gradient forward, the rows' and
weights' back. ``autopar/lowerings/experts.py:EXPERT_NODE_ALL_TO_ALL`` prices exactly these.

Groups: the rail and node groups are made once per (mesh, axis, m) on first use, each by its own
members only (``new_group(use_local_synchronization=True)``), so ranks that never run the layer
(other pipeline stages) need not take part.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from autopar.codegen.collectives import current_mesh
from autopar.codegen.experts import experts_per_rank
from autopar.kernels.moe import Act, MoeOperands, autocast_operands, experts_mlp, route

# the mesh attribute that keeps its groups made here: (axis, m) -> (rail, node)
NODE_GROUPS_ATTR = "_autopar_node_groups"


def axis_ranks(mesh: DeviceMesh, axis: int) -> list[int]:
    """The global ranks of this rank's group along ``axis``, by coordinate."""
    coord = mesh.get_coordinate()
    index = tuple(slice(None) if a == axis else c for a, c in enumerate(coord))
    return mesh.mesh[index].tolist()


def node_groups(
    mesh: DeviceMesh, axis: int, m: int
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's rail group (the axis's coordinates with its local index, one per node) and node
    group (the ``m`` coordinates of its node), for ``m`` coordinates of ``axis`` per node; None
    for a group of one rank (no collective runs there). Made on first use and kept on the mesh
    (a new process group, a new mesh: new groups)."""
    ranks = axis_ranks(mesh, axis)
    n, r = len(ranks), mesh.get_local_rank(axis)
    if m < 1 or n % m:
        raise ValueError(
            f"a node-deduplicated expert dispatch over {n} ranks with {m} per node: the axis must span "
            "whole nodes (plan with the flat all-to-all where it does not)"
        )
    cache = mesh.__dict__.setdefault(NODE_GROUPS_ATTR, {})
    if (axis, m) not in cache:
        q, local = divmod(r, m)
        cache[axis, m] = tuple(
            dist.new_group(members, use_local_synchronization=True) if len(members) > 1 else None
            for members in (ranks[local::m], ranks[q * m : (q + 1) * m])
        )
    return cache[axis, m]


def _exchange(x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.splits, ctx.group = (send, recv), group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, g):
        send, recv = ctx.splits
        return _exchange(g, recv, send, ctx.group), None, None, None


def destinations(ids: Tensor, block: int, size: int, first: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """For routing ``ids`` ``[T, k]`` and ``size`` members holding ``block`` experts each, member
    ``d`` experts ``(first + d) block ..``: the copies to send, ordered by member then token, as
    (member, token) index pairs, and the copies per member ``[size]``. A token goes once to each
    member that holds any of its experts; pairs of experts no member holds go nowhere (a copy that
    reached a node carries its pairs on other nodes too)."""
    tokens, k = ids.shape
    member = (torch.div(ids, block, rounding_mode="floor") - first).t().reshape(-1)
    token = torch.arange(tokens, device=ids.device).repeat(k)
    held = (member >= 0) & (member < size)
    hit = torch.zeros(size, tokens, dtype=torch.bool, device=ids.device)
    hit[member[held], token[held]] = True
    member, token = hit.nonzero(as_tuple=True)  # row-major: by member, then token
    return member, token, hit.sum(1)


def _dedup(
    x: Tensor, weights: Tensor, ids: Tensor, block: int, first: int, group, size: int, inner: Callable
) -> Tensor:
    """One dispatch level over ``group`` of ``size`` members (module docstring): each token's
    rows once to each member holding any of its experts, ``inner`` there, partials back, summed
    at home in member order. A group of one rank (None): ``inner`` on every copy, which is every
    token (each has a pair there), the same sums."""
    if group is None:
        return inner(x, weights, ids)
    _, token, counts = destinations(ids, block, size, first)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts.contiguous(), group=group)
    send, recv = counts.tolist(), recv_counts.tolist()
    rows = _AllToAllV.apply(x[token], send, recv, group)
    w = _AllToAllV.apply(weights[token], send, recv, group)
    i = _exchange(ids[token], send, recv, group)
    back = _AllToAllV.apply(inner(rows, w, i), recv, send, group)
    out = x.new_zeros(x.shape[0], back.shape[1], dtype=back.dtype)
    start = 0
    for c in send:  # members in increasing order; one member's tokens are distinct
        out = out.index_add(0, token[start : start + c], back[start : start + c])
        start += c
    return out


def local_pairs(op: MoeOperands) -> Tensor:
    """Each copy's partial over the pairs of this rank's experts (``op.first_expert ..``; ``op.x``
    the copies' rows): ``moe_experts``'s sum, but only those pairs' rows gathered and run (a copy
    carries all ``k`` of its token's pairs, most of them elsewhere), each copy's terms added in
    increasing ``j`` from zeros: one ``index_add`` per rank of a pair among its copy's local pairs,
    whose copies are distinct."""
    rows, ids = op.x, op.ids
    tokens, k = ids.shape
    routing = route(ids, op.num_experts, op.first_expert, op.w_in.shape[0])
    mine = routing.order[: int(routing.counts.sum())]
    out = experts_mlp(
        rows[torch.div(mine, k, rounding_mode="floor")],
        routing.counts,
        op.w_in,
        op.w_up,
        op.w_out,
        op.act,
        op.gated,
        op.transposed,
    )
    weighted = out * op.weights.reshape(-1)[mine].unsqueeze(-1)
    pair = torch.sort(mine).indices  # the local pairs by copy, then j
    copy = torch.div(mine[pair], k, rounding_mode="floor")
    first_of = torch.searchsorted(copy, copy)  # each pair's copy's first local pair
    nth = torch.arange(copy.numel(), device=copy.device) - first_of
    total = rows.new_zeros(tokens, rows.shape[1], dtype=weighted.dtype)
    # once at least: a rank with no pair of its own still joins autograd's graph (its backward
    # all-to-alls must run as every other rank's do)
    for j in range(int(nth.max()) + 1 if nth.numel() else 1):
        at = pair[nth == j]
        total = total.index_add(0, torch.div(mine[at], k, rounding_mode="floor"), weighted[at])
    return total.to(rows.dtype)  # the partials travel in the op dtype, as moe_experts returns them


def expert_parallel_nodes(op: MoeOperands, axis: int, ranks_per_node: int) -> Tensor:
    """This rank's rows of the layer's output, its tokens dispatched once per destination node over
    the rail, then once per destination rank inside the node, and combined the reverse way
    (module docstring); ``op``: this rank's rows and experts. ``ranks_per_node``: the coordinates
    of ``axis`` in one node."""
    mesh = current_mesh()
    n, m = mesh.size(axis), ranks_per_node
    local = experts_per_rank(op, n)
    rail, node = node_groups(mesh, axis, m)
    dtype = op.x.dtype
    x, w_in, w_up, w_out = autocast_operands(op.x, op.w_in, op.w_up, op.w_out)
    experts = op._replace(w_in=w_in, w_up=w_up, w_out=w_out, act=Act.of(op.act))
    first = mesh.get_local_rank(axis) * local

    def on_rank(rows, w, i):
        return local_pairs(experts._replace(x=rows, weights=w, ids=i, first_expert=first))

    def on_node(rows, w, i):  # the copies that reached this node: to its ranks (node q's first is q m)
        return _dedup(rows, w, i, local, first_rank, node, m, on_rank)

    first_rank = mesh.get_local_rank(axis) // m * m
    return _dedup(
        x.to(w_in.dtype), op.weights, op.ids, op.num_experts // (n // m), 0, rail, n // m, on_node
    ).to(dtype)
