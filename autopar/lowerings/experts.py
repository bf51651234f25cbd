"""The mixture-of-experts op (``autopar::moe_experts``) with its experts split over a mesh axis.

``expert_all_to_all`` (``ExpertDispatch.ALL_TO_ALL``, ``codegen/experts.py:expert_parallel``):
tokens and experts split on axis ``a`` of ``n`` ranks. Forward: the counts of (token, expert)
pairs per expert go to every rank first (``E`` int64 per rank), then the pairs' rows
(``T / n * k`` rows of ``H`` in the experts' weights' dtype per rank, balanced) to their experts' ranks, and
the experts' results back the same way. Backward: the results' gradients to the experts' ranks and
the rows' gradients back. None hides behind compute: each waits for the one before it.

``local_experts`` (experts split, tokens whole; ``codegen/experts.py:local_experts``): each rank
runs the pairs of the experts it holds; its output is a summand, reduced by the reshard that reads
it. No collective inside.

Routing is priced balanced unless the search says otherwise (``SearchOptions.expert_skew``, marked
on the node: ``passes/experts.py:mark_skew``): the busiest rank's experts get ``skew`` times the
balanced ``T k / n`` pairs, so its all-to-alls move ``skew`` times the rows and its experts' matmuls
take ``skew`` times as long (``LoweringPlan.work``), under either lowering.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.kernels import moe  # noqa: F401  (registers autopar::moe_experts)
from autopar.lowerings import Collective, Lowering, LoweringCall, LoweringPlan, Phase, register
from autopar.placement import ExpertDispatch, is_replicate, is_shard, volume_factor

# the busiest rank's share of the pairs over a balanced share, where the search marks none
SKEW = 1.0
SKEW_META = "autopar_expert_skew"  # passes/experts.py:mark_skew (SearchOptions.expert_skew)


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


def _local(node: fx.Node, s, mesh_shape: tuple[int, ...]) -> LoweringPlan | None:
    a = experts_axis(s, mesh_shape)
    if a is None or s.via_axis(ExpertDispatch.ALL_TO_ALL) is not None or not is_replicate(s.ins[0][a]):
        return None
    return LoweringPlan(work=node.meta.get(SKEW_META, SKEW))


MOE = torch.ops.autopar.moe_experts.default
EXPERT_ALL_TO_ALL = register(Lowering("expert_all_to_all", (MOE,), _all_to_all))
LOCAL_EXPERTS = register(Lowering("local_experts", (MOE,), _local))
