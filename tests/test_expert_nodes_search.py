"""The expert dispatch once per node (``ExpertDispatch.NODE_ALL_TO_ALL``) is priced as it runs and
chosen where the expert axis spans nodes.

* ``expected_distinct`` (the expected destination nodes of a token under balanced top-k routing)
  against the copies ``codegen/experts_nodes.py:destinations`` makes on uniformly drawn routings.
* The comm model prices a rail's all-to-all on the inter-node link over the nodes' ranks and a
  node's on the intra-node link over its ranks.
* A Mixtral-shaped model on 2 nodes of 4 H100 (meta device, priced only) with an expert axis of 8:
  the search dispatches once per node, its collectives are the rail's and the node's at the
  formula's bytes, the summary names it, and the step is faster than the flat all-to-all's, which
  the same plan on one node of 8 (where the axis spans no node) keeps.
"""

from __future__ import annotations

import math

import pytest
import torch

import autopar
from autopar import AxisRole, Outputs, Precision
from autopar.cost_model.comm import CommModel, collective_time
from autopar.lowerings.experts import expected_distinct
from autopar.placement import ExpertDispatch, via_from_str
from autopar.reshard import AxisGroup, Collective

MOE = "autopar.moe_experts.default"


@pytest.mark.parametrize("experts,k,groups", [(8, 2, 2), (128, 8, 4), (64, 6, 8), (16, 1, 4), (8, 8, 2)])
def test_expected_destinations_match_drawn_routings(experts, k, groups):
    from autopar.codegen.experts_nodes import destinations

    g = torch.Generator().manual_seed(experts * 31 + k)
    tokens = 4000
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    _, token, counts = destinations(ids, experts // groups, groups)
    per_token = token.numel() / tokens
    assert counts.sum() == token.numel()
    want = expected_distinct(experts, k, groups)
    # the mean of 4000 draws of a count in [1, groups]: within 3 standard errors (at most groups / 2)
    assert abs(per_token - want) < 3 * (groups / 2) / math.sqrt(tokens), (per_token, want)
    if k == 1:
        assert want == pytest.approx(1.0)
    if k == experts:
        assert want == pytest.approx(groups)


def test_rails_and_nodes_are_priced_on_their_links():
    cluster = autopar.ClusterSpec.preset("h100-sxm", 2, 4)
    comm = CommModel(cluster, (8,))
    b = 3e8
    a2a = Collective.ALL_TO_ALL
    assert comm.time(a2a, b, 0, AxisGroup.RAIL) == collective_time(a2a, b, 2, cluster.inter_node)
    assert comm.time(a2a, b, 0, AxisGroup.NODE) == collective_time(a2a, b, 4, cluster.intra_node)
    assert comm.time(a2a, b, 0, AxisGroup.NODE) < comm.time(a2a, b, 0, AxisGroup.RAIL) < comm.time(a2a, b, 0)
    # an axis whose every rank is in a node of its own (the 2-way axis inside each node after it):
    # the rail is the whole group, on the inter-node link
    wide = CommModel(autopar.ClusterSpec.preset("h100-sxm", 4, 2), (4, 2))
    assert wide.time(a2a, b, 0, AxisGroup.RAIL) == collective_time(a2a, b, 4, cluster.inter_node)
    with pytest.raises(ValueError, match="whole nodes"):
        wide.time(a2a, b, 1, AxisGroup.RAIL)
    with pytest.raises(ValueError, match="whole nodes"):
        CommModel(autopar.ClusterSpec.preset("h100-sxm", 1, 8), (8,)).time(a2a, b, 0, AxisGroup.RAIL)


tf = pytest.importorskip("transformers")
TOKENS, HIDDEN = 16 * 1024, 1024


def _plan(nodes: int, per_node: int, **options):
    cfg = tf.MixtralConfig(
        num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=3584, num_attention_heads=16,
        num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=8192, use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = tf.MixtralForCausalLM(cfg)
    ids = torch.zeros(8, TOKENS // 8, dtype=torch.long, device="meta")
    cluster = autopar.ClusterSpec.preset("h100-sxm", nodes, per_node)
    return autopar.plan(
        model, cluster, {"input_ids": ids, "labels": ids}, outputs=Outputs.LOSS, precision=Precision.BF16,
        pipeline_stages=1, mesh_shape=(8,), axis_roles=(AxisRole.EXPERT,), **options,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plans():
    return _plan(2, 4), _plan(1, 8)


def test_an_expert_axis_over_nodes_dispatches_once_per_node(plans):
    nodes, one = plans
    moe = [d for d in nodes.decisions if d.op == MOE]
    assert moe and all(via_from_str(d.via)[0] is ExpertDispatch.NODE_ALL_TO_ALL for d in moe), nodes.summary()
    assert "once per node" in nodes.summary()
    flat = [d for d in one.decisions if d.op == MOE]
    assert flat and all(via_from_str(d.via)[0] is ExpertDispatch.ALL_TO_ALL for d in flat)
    rows = TOKENS // 8 * HIDDEN * 2  # a rank's tokens, bf16
    for d in moe:
        inside = [c for c in d.collectives if c.site.value == "inside"]
        rail = [c for c in inside if c.group is AxisGroup.RAIL and c.phase.value == "forward"]
        node = [c for c in inside if c.group is AxisGroup.NODE and c.phase.value == "forward"]
        # counts, rows, weights, ids, partials back; 8 experts top-2 over 2 nodes: 1.57 copies a token
        assert [c.nbytes for c in rail][1] == pytest.approx(rows * expected_distinct(8, 2, 2))
        assert [c.nbytes for c in rail][4] == pytest.approx(rows * expected_distinct(8, 2, 2))
        assert [c.nbytes for c in node][1] == pytest.approx(rows * expected_distinct(8, 2, 8))
        assert len(rail) == len(node) == 5
    assert not any(c.group is not AxisGroup.WHOLE for d in flat for c in d.collectives)


def test_once_per_node_is_cheaper_than_the_flat_all_to_all_over_nodes(plans):
    """The flat dispatch's rows over the same 2-node axis cost more than the node dispatch's
    calls: the same model's MoE op priced both ways on the 2 x 4 cluster."""
    nodes, _ = plans
    d = next(d for d in nodes.decisions if d.op == MOE)
    cluster = autopar.ClusterSpec.preset("h100-sxm", 2, 4)
    comm = CommModel(cluster, (8,))
    node_s = sum(
        comm.time(c.kind, c.nbytes, c.axis, c.group) for c in d.collectives if c.site.value == "inside"
    )
    # the flat form: 5 all-to-alls, the rows of every (token, expert) pair over the whole axis
    pairs = TOKENS // 8 * 2 * HIDDEN * 2
    flat_s = comm.time(Collective.ALL_TO_ALL, 8 * 8, 0) + 4 * comm.time(Collective.ALL_TO_ALL, pairs, 0)
    assert node_s < flat_s


def test_the_flat_dispatch_can_be_forced(plans):
    """``expert_dispatch=ALL_TO_ALL`` (a run made with Megatron's "alltoall" dispatcher) keeps the
    flat all-to-all over nodes, priced slower than the search's own dispatch once per node; the
    node dispatch itself cannot be forced (the search takes it where it applies)."""
    nodes, _ = plans
    flat = _plan(2, 4, expert_dispatch=ExpertDispatch.ALL_TO_ALL)
    moe = [d for d in flat.decisions if d.op == MOE]
    assert moe and all(via_from_str(d.via)[0] is ExpertDispatch.ALL_TO_ALL for d in moe), flat.summary()
    assert flat.predicted.step_time_s > nodes.predicted.step_time_s
    with pytest.raises(autopar.SearchOptionsError, match="cannot be forced"):
        _plan(2, 4, expert_dispatch=ExpertDispatch.NODE_ALL_TO_ALL)
