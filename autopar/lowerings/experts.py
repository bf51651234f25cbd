r"""The mixture-of-experts op (``autopar::moe_experts``) with its experts split over a mesh axis.

``expert_all_to_all`` (``ExpertDispatch.ALL_TO_ALL``, ``codegen/experts.py:expert_parallel``):
tokens and experts split on axis ``a`` of ``n`` ranks. Forward: the counts of (token, expert)
pairs per expert go to every rank first (``E`` int64 per rank), then the pairs' rows
(``T / n * k`` rows of ``H`` in the experts' weights' dtype per rank, balanced) to their experts' ranks, and
the experts' results back the same way. Backward: the results' gradients to the experts' ranks and
the rows' gradients back. None hides behind compute: each waits for the one before it.

``expert_node_all_to_all`` (``ExpertDispatch.NODE_ALL_TO_ALL``,
``codegen/experts_nodes.py:expert_parallel_nodes``): the same split on an axis whose group spans
``N`` whole nodes with ``m`` of its ``n`` ranks in each (``autopar/reshard.py:expert_nodes``:
``m = 1`` where each rank of the axis is in a node of its own, then the rail is the whole group
and the node level is skipped; the
MoE op marked with the cluster's devices per node, ``NODES_META``). A token goes once to each
node that holds any of its experts, over the rail (``AxisGroup.RAIL``: ``N`` ranks, the
inter-node link), and once from there to each rank of the node that holds any
(``AxisGroup.NODE``: ``m`` ranks, the intra-node link). Under balanced routing (each token's
``k`` experts ``k`` distinct ones of ``E``, uniformly), the expected distinct holders among ``G``
equal blocks of experts is

.. math::

    D_G = G \left(1 - \binom{E - E/G}{k} \Big/ \binom{E}{k}\right)

(``expected_distinct``: a block is missed when all ``k`` fall outside it), so a rank of ``T``
tokens sends ``T D_N`` copies over its rail and its node sends ``T D_n`` over NVLink in all, its
ranks ``T D_n`` each on average (``D_n`` over the ``n`` ranks of the axis). The calls, in the
order the code issues them (``node_dispatch_calls``), with ``H`` the hidden size, ``e`` the
rows' element size (the op's dtype), ``w`` the router weights': per level (rail with ``c = T
D_N`` copies, then node with ``c = T D_n``): counts (``G`` int64), rows ``c H e``, weights ``c k
w``, ids ``c k 8``, the node level inside the rail's, each level's partials back ``c H e``;
backward, the partials' gradients forward and the rows' and weights' back. The rows move
``skew`` times as many bytes on the busiest rank, as under the flat form. It keeps nothing for
backward beyond what the op keeps (the copies are gathered by index, and each rank's experts see
only their own pairs' rows, as under the flat form). The local permutes (gathers of the copies,
the sums at home) are memory-bound copies of the same rows, not priced.

``local_experts`` (experts split, tokens whole; ``codegen/experts.py:local_experts``): each rank
runs the pairs of the experts it holds; its output is a summand, reduced by the reshard that reads
it. No collective inside.

Routing is priced balanced unless the search says otherwise (``SearchOptions.expert_skew``, marked
on the node: ``passes/experts.py:mark_skew``): the busiest rank's experts get ``skew`` times the
balanced ``T k / n`` pairs, so its all-to-alls move ``skew`` times the rows and its experts' matmuls
take ``skew`` times as long (``LoweringPlan.work``), under either lowering.

``packed_split`` / ``PackedSplit``: expert tensor parallelism of a packed gate-up stack (Hugging
Face's ``gate_up_proj``, ``[E, 2I, H]`` or ``[E, H, 2I]``: the gate's ``I`` rows, then the up's). A
``Shard`` of its ``2I`` dim in ``n`` pieces is right only where piece ``c`` holds the gate's block
``c`` and the up's block ``c`` together. So the parallel module stores that weight permuted, as

.. math::

    \mathrm{stored} = [\,g_0;\ u_0;\ g_1;\ u_1;\ \dots;\ g_{n-1};\ u_{n-1}\,],\qquad
    g_c = \mathrm{gate}[cI/n : (c+1)I/n],\ u_c = \mathrm{up}[cI/n : (c+1)I/n]

on that dim (``PackedSplit.to_stored``), and every placement the plan gives the weight is one of
the stored tensor: ``Shard`` cuts it into the ``[g_c; u_c]`` the op's ``chunk(2)`` reads as a gate
and an up of ``I/n`` rows each (the op itself on the local shards, no collective), and a reshard of
it (Replicate to Shard) slices the same pieces. Whole tensors cross the module's boundary in the
model's order: its pieces are cut from the stored order (``codegen/weights.py``), and
``full_state_dict``, ``full_grads`` and ``load_state_dict`` undo and redo the permutation
(``PackedSplit.from_stored``); a sharded ``state_dict()`` (for ``torch.distributed.checkpoint``)
holds the stored order. The permutation is a fixed gather on one dim: nothing at run time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.kernels import moe  # noqa: F401  (registers autopar::moe_experts)
from autopar.lowerings import AxisGroup, Collective, Lowering, LoweringCall, LoweringPlan, Phase, register
from autopar.placement import ExpertDispatch, is_replicate, is_shard, shard_factor, volume_factor
from autopar.reshard import expert_nodes

# the busiest rank's share of the pairs over a balanced share, where the search marks none
SKEW = 1.0
SKEW_META = "autopar_expert_skew"  # passes/experts.py:mark_skew (SearchOptions.expert_skew)
NODES_META = "autopar_devices_per_node"  # passes/experts.py:mark_nodes (the cluster's)


def experts_axis(s, mesh_shape) -> int | None:
    """The axis of more than one rank that splits the experts (their dim ``E``) under ``s`` (at most
    one does; a split of another dim is expert tensor parallelism, which runs the op as it is on
    the local shards: ``passes/rules/experts.py``)."""
    return next((a for a, p in enumerate(s.ins[3]) if is_shard(p) and p.dim == 0 and mesh_shape[a] > 1), None)


def _all_to_all(node: fx.Node, s, mesh_shape: tuple[int, ...]) -> LoweringPlan | None:
    a = experts_axis(s, mesh_shape)
    if a is None or s.via_axis(ExpertDispatch.ALL_TO_ALL) != a:
        return None
    x, ids, w_in = (node.args[i].meta["val"] for i in (0, 2, 3))
    k, experts = ids.shape[1], w_in.shape[0]
    rows = x.shape[0] / volume_factor(s.ins[0], mesh_shape) * k
    skew = node.meta.get(SKEW_META, SKEW)
    # the rows travel in the experts' matmuls' dtype: the weights' as traced, the half type under
    # mixed precision (autocast_operands), which the pricing applies (op_dtype)
    pairs = rows * x.shape[1] * w_in.element_size() * skew
    counts = experts * 8  # int64 per expert
    send = Collective.ALL_TO_ALL
    return LoweringPlan(
        work=skew,
        calls=(
            LoweringCall(send, a, counts, Phase.FORWARD),
            LoweringCall(send, a, pairs, Phase.FORWARD, op_dtype=True),
            LoweringCall(send, a, pairs, Phase.FORWARD, op_dtype=True),
            LoweringCall(send, a, pairs, Phase.BACKWARD, op_dtype=True),
            LoweringCall(send, a, pairs, Phase.BACKWARD, op_dtype=True),
        ),
    )


def expected_distinct(experts: int, k: int, groups: int) -> float:
    """The expected number of ``groups`` equal blocks of ``experts`` that hold any of a token's ``k``
    distinct experts, drawn uniformly (module docstring)."""
    if experts % groups:
        raise ValueError(f"{experts} experts do not split in {groups} equal blocks")
    k = min(k, experts)
    return groups * (1 - math.comb(experts - experts // groups, k) / math.comb(experts, k))


def node_dispatch_calls(
    axis: int,
    nodes: int,
    per_node: int,
    rail_copies: float,
    node_copies: float,
    k: int,
    row_bytes: float,
    weight_bytes: float,
    received: tuple[float, float] | None = None,
) -> tuple[LoweringCall, ...]:
    """The collectives of ``expert_parallel_nodes`` on one rank that sends ``rail_copies`` rows
    over its rail (of ``nodes`` ranks) and ``node_copies`` inside its node (of ``per_node``), each
    row ``row_bytes`` (``H e``), each router weight ``weight_bytes``: forward in the code's order,
    then backward. ``received``: the rows it receives over its rail and inside its node, which it
    sends back (the partials, the rows' and the weights' gradients); None: as many as it sends
    (balanced routing). A group of one rank issues nothing."""
    send, fwd, bwd = Collective.ALL_TO_ALL, Phase.FORWARD, Phase.BACKWARD
    got = received or (rail_copies, node_copies)
    levels = [
        (group, copies, back, size)
        for group, copies, back, size in (
            (AxisGroup.RAIL, rail_copies, got[0], nodes),
            (AxisGroup.NODE, node_copies, got[1], per_node),
        )
        if size > 1
    ]

    def rows(group, copies, phase):
        return LoweringCall(send, axis, copies * row_bytes, phase, op_dtype=True, group=group)

    def weights(group, copies, phase):
        return LoweringCall(send, axis, copies * k * weight_bytes, phase, group=group)

    forward = [
        c
        for group, copies, _, size in levels
        for c in (
            LoweringCall(send, axis, size * 8, fwd, group=group),  # the counts
            rows(group, copies, fwd),
            weights(group, copies, fwd),
            LoweringCall(send, axis, copies * k * 8, fwd, group=group),  # the ids
        )
    ]
    forward += [rows(group, back, fwd) for group, _, back, _ in reversed(levels)]  # the partials back
    backward = [
        c
        for group, copies, back, _ in levels
        # the partials' gradient out, the rows' and the weights' back
        for c in (rows(group, copies, bwd), rows(group, back, bwd), weights(group, back, bwd))
    ]
    return (*forward, *backward)


def _node_all_to_all(node: fx.Node, s, mesh_shape: tuple[int, ...]) -> LoweringPlan | None:
    a = experts_axis(s, mesh_shape)
    if a is None or s.via_axis(ExpertDispatch.NODE_ALL_TO_ALL) != a:
        return None
    split = ranks_per_node(node, mesh_shape, a)
    if split is None:
        return None
    m, nodes = split
    x, weights, ids, w_in = (node.args[i].meta["val"] for i in (0, 1, 2, 3))
    k, experts = ids.shape[1], w_in.shape[0]
    tokens = x.shape[0] / volume_factor(s.ins[0], mesh_shape)
    skew = node.meta.get(SKEW_META, SKEW)
    rail = tokens * expected_distinct(experts, k, nodes) * skew
    inside = tokens * expected_distinct(experts, k, m * nodes) * skew
    row = x.shape[1] * w_in.element_size()
    calls = node_dispatch_calls(a, nodes, m, rail, inside, k, row, weights.element_size())
    return LoweringPlan(work=skew, calls=calls)


def ranks_per_node(node: fx.Node, mesh_shape: Sequence[int], axis: int) -> tuple[int, int] | None:
    """(m, N): the ranks of ``axis`` in one node and the nodes its group spans, from the devices per
    node the MoE op ``node`` is marked with (None: not marked, or not whole nodes)."""
    dpn = node.meta.get(NODES_META)
    return None if dpn is None else expert_nodes(mesh_shape, axis, dpn)


def _local(node: fx.Node, s, mesh_shape: tuple[int, ...]) -> LoweringPlan | None:
    a = experts_axis(s, mesh_shape)
    if a is None or not is_replicate(s.ins[0][a]):
        return None
    if (
        s.via_axis(ExpertDispatch.ALL_TO_ALL) is not None
        or s.via_axis(ExpertDispatch.NODE_ALL_TO_ALL) is not None
    ):
        return None
    return LoweringPlan(work=node.meta.get(SKEW_META, SKEW))


MOE = torch.ops.autopar.moe_experts.default
EXPERT_ALL_TO_ALL = register(Lowering("expert_all_to_all", (MOE,), _all_to_all))
EXPERT_NODE_ALL_TO_ALL = register(Lowering("expert_node_all_to_all", (MOE,), _node_all_to_all))
LOCAL_EXPERTS = register(Lowering("local_experts", (MOE,), _local))


PACKED_INPUT = 3  # w_in: the op's tensor input a PackedSplit applies to


@dataclass(frozen=True)
class PackedSplit:
    """A packed gate-up weight stored for a split of its ``2I`` dim ``dim`` in ``parts`` pieces
    (module docstring): piece ``c`` of the stored tensor is the gate's block ``c``, then the up's."""

    dim: int
    parts: int

    def __post_init__(self):
        if self.parts < 1:
            raise ValueError(f"PackedSplit: parts={self.parts} must be at least 1")

    def index(self, size: int, device=None) -> torch.Tensor:
        """``stored = whole.index_select(dim, index)``: the model's rows in stored order."""
        if size % (2 * self.parts):
            raise ValueError(
                f"a packed gate-up dim of {size} rows does not split into {self.parts} pieces of matching "
                "gate and up halves: use a mesh axis that divides the experts' intermediate size"
            )
        block = size // (2 * self.parts)
        rows = torch.arange(size, device=device).view(2, self.parts, block)  # [gate | up][piece][row]
        return rows.transpose(0, 1).reshape(size)

    def to_stored(self, whole: torch.Tensor) -> torch.Tensor:
        d = self.dim % whole.dim()
        return whole.index_select(d, self.index(whole.shape[d], whole.device))

    def from_stored(self, stored: torch.Tensor) -> torch.Tensor:
        d = self.dim % stored.dim()
        return stored.index_select(d, torch.argsort(self.index(stored.shape[d], stored.device)))


def packed_split(node: fx.Node, s, mesh_shape) -> PackedSplit | None:
    """The stored layout of the packed gate-up weight (``w_in`` of a gated op without ``w_up``)
    that strategy ``s`` of MoE node ``node`` splits on its ``2I`` dim; None where it does not."""
    if node.target is not MOE:
        return None
    gated, w_up, transposed = node.args[7], node.args[4], node.args[8]
    if not gated or w_up is not None:
        return None
    dim = 1 if transposed else 2
    parts = shard_factor(s.ins[3], mesh_shape, dim)
    return PackedSplit(dim, parts) if parts > 1 else None


def packed_weights(graph: fx.Graph, choice: dict, mesh_shape) -> dict[str, PackedSplit]:
    """Placeholder name -> stored layout, of every packed gate-up weight that ``choice`` (node name
    -> strategy) splits on its ``2I`` dim. A weight read by anything but that one MoE op would see
    the stored order where it expects the model's: an error."""
    out: dict[str, PackedSplit] = {}
    for n in graph.nodes:
        split = (
            packed_split(n, choice[n.name], mesh_shape)
            if n.op == "call_function" and n.name in choice
            else None
        )
        if split is None:
            continue
        w = n.args[3]
        if getattr(w, "op", None) != "placeholder" or len(w.users) != 1:
            raise ValueError(
                f"{n.name}: its packed gate-up weight {w} is split on its 2I dim, which needs it to be a parameter "
                "read by this MoE op alone (it is stored permuted): plan with the experts whole on that axis"
            )
        out[w.name] = split
    return out
