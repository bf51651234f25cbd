"""Tests for autopar.cost_model.comm: ring collective formulas, mesh-axis links, resharding prices.

Every expected number below is worked out by hand from the formulas in the module docstring:

* all-reduce:                           2 (n-1)/n * B / bw + 2 (n-1) lat
* all-gather, reduce-scatter, all-to-all:  (n-1)/n * B / bw +   (n-1) lat
* send/recv:                                        B / bw +         lat
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.cluster import ClusterSpec, LinkSpec
from autopar.cost_model.comm import Collective, CommModel, axis_link, collective_time
from autopar.placement import spec_from_str
from autopar.reshard import Phase

# Round numbers so the hand computations are easy to follow.
INTRA = LinkSpec(bandwidth=1e11, latency=1e-6)  # 100 GB/s, 1 us
INTER = LinkSpec(bandwidth=1e10, latency=1e-5)  # 10 GB/s, 10 us


def _cluster(nodes: int, devices_per_node: int) -> ClusterSpec:
    """GPUs (whose transport has a reduce-scatter of its own: the ring formulas above hold for every
    collective) on the round-number links."""
    return ClusterSpec.preset("h100-sxm", nodes=nodes, devices_per_node=devices_per_node).with_overrides(
        intra_node=INTRA, inter_node=INTER
    )


def _names(calls) -> list[str]:
    """The collectives of a reshard as short text: ``all_gather@0``, ``all_reduce(bwd)@1``."""
    return [f"{c.kind.value}{'(bwd)' if c.phase is Phase.BACKWARD else ''}@{c.axis}" for c in calls]


def approx(x: float):
    return pytest.approx(x, rel=1e-12, abs=1e-18)


# ------------------------------------------------------------------------------------------ collective_time

LINK = LinkSpec(bandwidth=1e11, latency=1e-5)


def test_all_reduce_formula():
    # 2 * 7/8 * 1e9 / 1e11 = 0.0175 s; 2 * 7 * 1e-5 = 1.4e-4 s
    assert collective_time(Collective.ALL_REDUCE, 1e9, 8, LINK) == approx(0.0175 + 1.4e-4)
    assert collective_time(Collective.ALL_REDUCE, 1e9, 8, LINK) == approx(0.01764)
    # n = 2: 2 * 1/2 * 1e9 / 1e11 = 0.01; 2 * 1 * 1e-5 = 2e-5
    assert collective_time(Collective.ALL_REDUCE, 1e9, 2, LINK) == approx(0.01002)


@pytest.mark.parametrize("kind", [Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL])
def test_gather_scatter_alltoall_formula(kind):
    # 7/8 * 1e9 / 1e11 = 0.00875 s; 7 * 1e-5 = 7e-5 s
    assert collective_time(kind, 1e9, 8, LINK) == approx(0.00882)
    # 3/4 * 4e6 / 1e11 = 3e-5; 3 * 1e-5 = 3e-5
    assert collective_time(kind, 4e6, 4, LINK) == approx(6e-5)


def test_send_recv_formula():
    # 1e9 / 1e11 = 0.01 s; + 1e-5 s; independent of n (as long as n > 1)
    assert collective_time(Collective.SEND_RECV, 1e9, 8, LINK) == approx(0.01001)
    assert collective_time(Collective.SEND_RECV, 1e9, 2, LINK) == approx(0.01001)


def test_all_reduce_is_reduce_scatter_plus_all_gather():
    for n in (2, 3, 8, 64):
        ar = collective_time(Collective.ALL_REDUCE, 3e8, n, LINK)
        rs = collective_time(Collective.REDUCE_SCATTER, 3e8, n, LINK)
        ag = collective_time(Collective.ALL_GATHER, 3e8, n, LINK)
        assert ar == approx(rs + ag)


@pytest.mark.parametrize("kind", list(Collective))
def test_single_rank_and_empty_are_free(kind):
    assert collective_time(kind, 1e9, 1, LINK) == 0.0
    assert collective_time(kind, 0, 8, LINK) == 0.0


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(list(Collective)),
    n=st.integers(min_value=1, max_value=128),
    b1=st.integers(min_value=0, max_value=10**12),  # bytes are whole numbers
    b2=st.integers(min_value=0, max_value=10**12),
    bw=st.floats(min_value=1e6, max_value=1e13),
    lat=st.floats(min_value=0, max_value=1e-3),
)
def test_monotonic_in_bytes(kind, n, b1, b2, bw, lat):
    link = LinkSpec(bandwidth=bw, latency=lat)
    lo, hi = sorted((b1, b2))
    t_lo = collective_time(kind, lo, n, link)
    t_hi = collective_time(kind, hi, n, link)
    assert 0.0 <= t_lo <= t_hi
    if n > 1 and hi >= 2 * lo and hi > 0:  # at least 1 B more: well above float rounding of the latency term
        assert t_hi > t_lo
    if n == 1:
        assert t_hi == 0.0


@settings(max_examples=100, deadline=None)
@given(n=st.integers(min_value=2, max_value=128), b=st.floats(min_value=1.0, max_value=1e12))
def test_more_ranks_never_cheaper(n, b):
    # (n-1)/n and (n-1) both grow with n
    for kind in (Collective.ALL_REDUCE, Collective.ALL_GATHER):
        assert collective_time(kind, b, n + 1, LINK) >= collective_time(kind, b, n, LINK)


# ------------------------------------------------------------------------------------------ axis_link


def test_axis_link_2x4():
    cluster = _cluster(nodes=2, devices_per_node=4)
    # mesh (2, 4): axis 1 groups are 4 consecutive ranks (one node); axis 0 groups span 8 ranks (2 nodes)
    assert axis_link(cluster, (2, 4), 1) == INTRA
    assert axis_link(cluster, (2, 4), 0) == INTER
    # mesh (8,): one group of all 8 ranks crosses nodes
    assert axis_link(cluster, (8,), 0) == INTER
    # mesh (4, 2): axis 1 spans 2 ranks (intra), axis 0 spans 8 (inter)
    assert axis_link(cluster, (4, 2), 1) == INTRA
    assert axis_link(cluster, (4, 2), 0) == INTER
    # mesh (2, 2, 2): spans 2, 4 (both inside a node of 4) and 8
    assert [axis_link(cluster, (2, 2, 2), a) for a in range(3)] == [INTER, INTRA, INTRA]
    assert CommModel(cluster, (2, 4)).links == [INTER, INTRA]


def test_axis_link_single_node():
    cluster = _cluster(nodes=1, devices_per_node=8)
    assert axis_link(cluster, (8,), 0) == INTRA
    assert axis_link(cluster, (2, 4), 0) == INTRA
    assert axis_link(cluster, (2, 4), 1) == INTRA


# ------------------------------------------------------------------------------------------ CommModel.reshard, 1D

S0, S1, R, P = spec_from_str("S(0)"), spec_from_str("S(1)"), spec_from_str("R"), spec_from_str("P")
NB = 4e6  # global bytes of the tensor in the 1D tests

# mesh (4,) on one node of 4: the intra link (1e11 B/s, 1e-6 s), n = 4
AG_FULL = 3 / 4 * 4e6 / 1e11 + 3 * 1e-6  # 3.3e-5: all-gather / reduce-scatter of the full 4e6 B
AR_FULL = 2 * 3 / 4 * 4e6 / 1e11 + 2 * 3 * 1e-6  # 6.6e-5: all-reduce of the full 4e6 B


@pytest.fixture
def cm1() -> CommModel:
    return CommModel(_cluster(nodes=1, devices_per_node=4), (4,))


def test_hand_numbers_1d():
    assert AG_FULL == approx(3.3e-5)
    assert AR_FULL == approx(6.6e-5)


def test_shard_to_replicate(cm1):
    t, calls = cm1.reshard(S0, R, NB, requires_grad=False)
    assert t == approx(AG_FULL)
    assert _names(calls) == ["all_gather@0"]
    # without an "f" the backward is a local slice: same price with a gradient
    t, calls = cm1.reshard(S0, R, NB, requires_grad=True)
    assert t == approx(AG_FULL)
    assert _names(calls) == ["all_gather@0"]


def test_replicate_to_shard(cm1):
    assert cm1.reshard(R, S0, NB, requires_grad=False) == (0.0, ())
    t, calls = cm1.reshard(R, S0, NB, requires_grad=True)
    assert t == approx(AG_FULL)
    assert _names(calls) == ["all_gather(bwd)@0"]


def test_partial_to_replicate(cm1):
    for rg in (False, True):
        t, calls = cm1.reshard(P, R, NB, requires_grad=rg)
        assert t == approx(AR_FULL)
        assert _names(calls) == ["all_reduce@0"]


def test_partial_to_shard(cm1):
    t, calls = cm1.reshard(P, S0, NB, requires_grad=False)
    assert t == approx(AG_FULL)  # reduce-scatter prices like an all-gather
    assert _names(calls) == ["reduce_scatter@0"]
    t, calls = cm1.reshard(P, S0, NB, requires_grad=True)
    assert t == approx(2 * AG_FULL)
    assert _names(calls) == ["reduce_scatter@0", "all_gather(bwd)@0"]


def test_shard_to_other_shard(cm1):
    t, calls = cm1.reshard(S0, S1, NB, requires_grad=False)
    assert t == approx(AG_FULL)
    assert _names(calls) == ["all_gather@0"]
    t, _ = cm1.reshard(S0, S1, NB, requires_grad=True)
    assert t == approx(2 * AG_FULL)


@pytest.mark.parametrize("spec", [R, P, S0, S1])
def test_same_placement_is_free(cm1, spec):
    assert cm1.reshard(spec, spec, NB, requires_grad=False) == (0.0, ())
    assert cm1.reshard(spec, spec, NB, requires_grad=True) == (0.0, ())


def test_replicate_to_partial_is_free(cm1):
    assert cm1.reshard(R, P, NB, requires_grad=True) == (0.0, ())


def test_single_device_axis_is_free():
    cm = CommModel(_cluster(nodes=1, devices_per_node=4), (1, 4))
    # axis 0 has one rank: nothing to move there
    assert cm.reshard(spec_from_str("S(0),R"), spec_from_str("R,R"), NB, requires_grad=True) == (0.0, ())
    assert cm.reshard(spec_from_str("P,R"), spec_from_str("R,R"), NB, requires_grad=True) == (0.0, ())


def test_fused_f_reduce_scatter(cm1):
    t_fused, calls = cm1.reshard(S0, R, NB, requires_grad=True, f_axes=[0])
    # forward all-gather of the full tensor + backward reduce-scatter of the full gradient
    assert t_fused == approx(AG_FULL + AG_FULL)
    assert t_fused == approx(6.6e-5)
    assert _names(calls) == ["all_gather@0", "reduce_scatter(bwd)@0"]
    # the unfused form: all-gather, then f's all-reduce of the full gradient, then a slice
    unfused = AG_FULL + AR_FULL
    assert unfused == approx(9.9e-5)
    assert t_fused <= unfused
    # without a gradient the "f" costs nothing
    t, calls = cm1.reshard(S0, R, NB, requires_grad=False, f_axes=[0])
    assert t == approx(AG_FULL)
    assert _names(calls) == ["all_gather@0"]


def test_f_alone_is_a_backward_all_reduce(cm1):
    t, calls = cm1.reshard(R, R, NB, requires_grad=True, f_axes=[0])
    assert t == approx(AR_FULL)
    assert _names(calls) == ["all_reduce(bwd)@0"]
    assert cm1.reshard(R, R, NB, requires_grad=False, f_axes=[0]) == (0.0, ())
    # f on a sharded destination: the backward all-reduce is of the (local) shard, 1e6 B
    t, calls = cm1.reshard(R, S0, NB, requires_grad=True, f_axes=[0])
    ar_shard = 2 * 3 / 4 * 1e6 / 1e11 + 2 * 3 * 1e-6  # 2.1e-5
    assert t == approx(AG_FULL + ar_shard)
    assert _names(calls) == ["all_gather(bwd)@0", "all_reduce(bwd)@0"]


# ------------------------------------------------------------------------------------------ CommModel.reshard, 2D

# mesh (2, 4) on 2 nodes x 4: axis 0 (n=2) on INTER (1e10 B/s, 1e-5 s), axis 1 (n=4) on INTRA (1e11, 1e-6)
NB2 = 8e6


@pytest.fixture
def cm2() -> CommModel:
    return CommModel(_cluster(nodes=2, devices_per_node=4), (2, 4))


def test_2d_gather_both_axes(cm2):
    # S(0),S(1) -> R,R; each rank holds 8e6 / (2*4) = 1e6 B.
    # axis 0 first: gather over 2 ranks, the tensor is still split over axis 1 -> full-over-axis-0 = 2e6 B
    #   1/2 * 2e6 / 1e10 + 1 * 1e-5 = 1e-4 + 1e-5 = 1.1e-4
    # axis 1 next: each rank now holds 2e6 B, gather over 4 ranks -> full = 8e6 B
    #   3/4 * 8e6 / 1e11 + 3 * 1e-6 = 6e-5 + 3e-6 = 6.3e-5
    # total 1.73e-4
    t, calls = cm2.reshard(spec_from_str("S(0),S(1)"), spec_from_str("R,R"), NB2, requires_grad=False)
    assert t == approx(1.1e-4 + 6.3e-5)
    assert t == approx(1.73e-4)
    assert _names(calls) == ["all_gather@0", "all_gather@1"]


def test_2d_reduce_and_gather(cm2):
    # P,S(0) -> R,R; each rank holds 8e6 / 4 = 2e6 B (Partial keeps the full size over axis 0).
    # axis 0: all-reduce of 2e6 B over 2 ranks: 2 * 1/2 * 2e6 / 1e10 + 2 * 1e-5 = 2e-4 + 2e-5 = 2.2e-4
    # axis 1: all-gather to the full 8e6 B over 4 ranks: 6.3e-5
    t, calls = cm2.reshard(spec_from_str("P,S(0)"), spec_from_str("R,R"), NB2, requires_grad=False)
    assert t == approx(2.2e-4 + 6.3e-5)
    assert _names(calls) == ["all_reduce@0", "all_gather@1"]


def test_2d_backward_gathers(cm2):
    # R,R -> S(0),S(1) with a gradient: forward slices are free; backward gathers the gradient.
    # axis 0: all-gather of 8e6 B over 2 ranks (inter): 1/2 * 8e6 / 1e10 + 1e-5 = 4.1e-4; then 4e6 B per rank
    # axis 1: all-gather of 4e6 B over 4 ranks (intra): 3/4 * 4e6 / 1e11 + 3e-6 = 3.3e-5
    src, dst = spec_from_str("R,R"), spec_from_str("S(0),S(1)")
    assert cm2.reshard(src, dst, NB2, requires_grad=False) == (0.0, ())
    t, calls = cm2.reshard(src, dst, NB2, requires_grad=True)
    assert t == approx(4.1e-4 + 3.3e-5)
    assert _names(calls) == ["all_gather(bwd)@0", "all_gather(bwd)@1"]


def test_2d_gathers_before_slices(cm2):
    # R,S(0) -> S(0),R: the axis that becomes Replicate (1) is handled first, then the slice on axis 0.
    # axis 1: each rank holds 8e6 / 4 = 2e6 B; all-gather to 8e6 B over 4 ranks (intra): 6.3e-5
    # axis 0: slice (free forward); backward all-gather of the 8e6 B gradient over 2 ranks (inter): 4.1e-4
    # (slicing axis 0 first would have priced that backward gather at 2e6 B: 1.1e-4 -- wrong)
    src, dst = spec_from_str("R,S(0)"), spec_from_str("S(0),R")
    t, calls = cm2.reshard(src, dst, NB2, requires_grad=False)
    assert t == approx(6.3e-5)
    assert _names(calls) == ["all_gather@1"]
    t, calls = cm2.reshard(src, dst, NB2, requires_grad=True)
    assert t == approx(6.3e-5 + 4.1e-4)
    assert _names(calls) == ["all_gather@1", "all_gather(bwd)@0"]


def test_2d_sum_of_single_axis_costs(cm2):
    # a transition on both axes costs the same as the two one-axis transitions done in turn,
    # each priced at the size the tensor has when it happens
    both, _ = cm2.reshard(spec_from_str("S(0),S(1)"), spec_from_str("R,R"), NB2, requires_grad=False)
    first, _ = cm2.reshard(spec_from_str("S(0),S(1)"), spec_from_str("R,S(1)"), NB2, requires_grad=False)
    second, _ = cm2.reshard(spec_from_str("R,S(1)"), spec_from_str("R,R"), NB2, requires_grad=False)
    assert first == approx(1.1e-4)
    assert second == approx(6.3e-5)
    assert both == approx(first + second)


def test_2d_fused_f_on_one_axis(cm2):
    # S(0),R -> R,R with f on axis 0 and a gradient:
    # each rank holds 8e6 / 2 = 4e6 B; axis 0: all-gather of 8e6 B over 2 ranks (inter) = 4.1e-4,
    # fused backward reduce-scatter of 8e6 B over 2 ranks = 4.1e-4
    t, calls = cm2.reshard(spec_from_str("S(0),R"), spec_from_str("R,R"), NB2, requires_grad=True, f_axes=[0])
    assert t == approx(8.2e-4)
    assert _names(calls) == ["all_gather@0", "reduce_scatter(bwd)@0"]
    # f on axis 1 instead is not fused: backward all-reduce of the 8e6 B gradient over 4 ranks (intra)
    # 2 * 3/4 * 8e6 / 1e11 + 2 * 3 * 1e-6 = 1.2e-4 + 6e-6 = 1.26e-4
    t, calls = cm2.reshard(spec_from_str("S(0),R"), spec_from_str("R,R"), NB2, requires_grad=True, f_axes=[1])
    assert t == approx(4.1e-4 + 1.26e-4)
    assert _names(calls) == ["all_gather@0", "all_reduce(bwd)@1"]


# ------------------------------------------------------------------------------ tree and hierarchical


def test_tree_all_reduce_only_across_nodes_and_only_when_cheaper():
    from autopar.cost_model.comm import tree_all_reduce_time

    # 16 ranks, 1 KB: tree = 2*4*1e-5 + 2*1e3/1e10 = 8.02e-5; ring = 2*15/16*1e-7 + 30*1e-5 = 3.0019e-4
    assert tree_all_reduce_time(1e3, 16, INTER) == approx(8.02e-5)
    across = CommModel(_cluster(16, 1), (16,))  # one device per node: the axis crosses nodes
    assert across.time(Collective.ALL_REDUCE, 1e3, 0) == approx(8.02e-5)
    # 1 GB: ring 2*15/16*0.1 + 3e-4 = 0.1878 beats tree 8e-5 + 0.2
    assert across.time(Collective.ALL_REDUCE, 1e9, 0) == approx(0.1875 + 3e-4)
    inside = CommModel(_cluster(1, 16), (16,))  # inside a node NCCL rings: no tree
    assert inside.time(Collective.ALL_REDUCE, 1e3, 0) == approx(2 * 15 / 16 * 1e3 / 1e11 + 30 * 1e-6)


def test_hierarchical_collectives_on_an_axis_spanning_whole_nodes():
    """Mesh (8,) on 2 nodes x 4: intra reduce-scatter over 4, inter all-reduce over 2 on a quarter,
    intra all-gather over 4 -- cheaper than a flat ring over the inter-node link."""
    m = CommModel(_cluster(2, 4), (8,))
    b = 1e8
    rs_intra = 3 / 4 * b / 1e11 + 3 * 1e-6  # 7.5e-4 + 3e-6
    ar_inter = min(
        2 * 1 / 2 * (b / 4) / 1e10 + 2 * 1e-5, 2 * 1 * 1e-5 + 2 * (b / 4) / 1e10
    )  # ring 2.5e-3+2e-5
    ag_intra = rs_intra
    assert m.time(Collective.ALL_REDUCE, b, 0) == approx(rs_intra + ar_inter + ag_intra)
    flat = 2 * 7 / 8 * b / 1e10 + 14 * 1e-5
    assert m.time(Collective.ALL_REDUCE, b, 0) < flat
    assert m.time(Collective.ALL_GATHER, b, 0) == approx((1 / 2 * (b / 4) / 1e10 + 1e-5) + ag_intra)
    assert m.time(Collective.REDUCE_SCATTER, b, 0) == approx(rs_intra + (1 / 2 * (b / 4) / 1e10 + 1e-5))
    # an axis inside a node, or strictly across nodes, is not split
    assert CommModel(_cluster(2, 4), (2, 4)).splits == [None, None]


def test_split_mean_cross_entropy_pays_its_all_reduces_on_every_split_axis(monkeypatch):
    """The lowering all-reduces loss sum and token count (one collective) on each axis the batch is split over; the
    price must follow, whichever axis that is (not axis 0's alone). A loss the graph only returns, split over one
    axis, runs it off the step's path (``LoweringCall.deferred``): the same record, at no seconds."""
    import torch
    from torch.distributed.tensor.placement_types import Shard

    import autopar.lowerings.loss as loss
    from autopar.passes.op_price import lowering_collectives
    from autopar.tools.validate import node_strategies, one_node_graph

    logits, target = torch.randn(8, 5), torch.randint(0, 5, (8,))
    node, _ = one_node_graph(torch.ops.aten.cross_entropy_loss.default, (logits, target), None)
    comm = CommModel(_cluster(1, 4), (2, 2))
    per_axis = comm.time(Collective.ALL_REDUCE, 8, 0)  # sum and count, two float32, at once
    assert per_axis > 0

    def priced():
        by_split = {}
        for s in node_strategies(node, (2, 2)):
            by_split[tuple(isinstance(p, Shard) for p in s.ins[0])] = lowering_collectives(node, s, comm)
        return by_split

    returned = priced()  # the one-node graph returns the loss alone
    assert [(_names([c]), t) for c, t in returned[(True, False)]] == [(["all_reduce@0"], 0.0)]
    assert [(_names([c]), t) for c, t in returned[(False, True)]] == [(["all_reduce@1"], 0.0)]
    monkeypatch.setattr(loss, "returned_alone", lambda node, rows: False)
    by_split = priced()
    assert by_split[(False, False)] == []
    assert [(_names([c]), t) for c, t in by_split[(True, False)]] == [(["all_reduce@0"], approx(per_axis))]
    # split on axis 1 only: priced on axis 1
    assert [(_names([c]), t) for c, t in by_split[(False, True)]] == [(["all_reduce@1"], approx(per_axis))]


def test_queued_all_reduce_uses_its_own_ranges_else_the_inline_price():
    from autopar.cost_model.comm import QUEUED_ALL_REDUCE

    base = ClusterSpec.preset("cpu", devices_per_node=2)
    plain = CommModel(base, (2,))
    assert plain.queued_all_reduce_time(2**16, 0) == plain.time(Collective.ALL_REDUCE, 2**16, 0)
    link = LinkSpec(1e9, 1e-3, ranges=((QUEUED_ALL_REDUCE, 2.0**20, 1e9, 2e-4),))
    cm = CommModel(base.with_overrides(intra_node=link, inter_node=link), (2,))
    # ring all-reduce over 2 ranks: B / bw + 2 lat, with the queued entry's latency
    assert cm.queued_all_reduce_time(2**16, 0) == pytest.approx(2**16 / 1e9 + 2 * 2e-4)
    assert cm.time(Collective.ALL_REDUCE, 2**16, 0) == pytest.approx(2**16 / 1e9 + 2 * 1e-3)


def test_an_axis_takes_its_groups_figures_where_calibrated_else_the_collectives_own():
    """A link with ``group_ranges`` entries prices the axes whose groups they name (size and
    stride, inside a node) with them, the queued all-reduce too; the whole node's group, a layout
    not measured and an axis across nodes keep the collective's own figures."""
    from autopar.cost_model.comm import QUEUED_ALL_REDUCE, group_ranges

    big = 2.0**30
    link = LinkSpec(
        1e9,
        1e-3,
        ranges=(
            ("all_reduce", big, 1e9, 1e-3),
            (group_ranges("all_reduce", 2, 1), big, 1e9, 5e-3),  # neighbours
            (group_ranges("all_reduce", 2, 2), big, 1e9, 2e-3),  # two apart
            (QUEUED_ALL_REDUCE, big, 1e9, 1e-4),
            (group_ranges(QUEUED_ALL_REDUCE, 2, 1), big, 1e9, 3e-4),
        ),
    )
    one_node = ClusterSpec.preset("cpu", devices_per_node=4).with_overrides(intra_node=link, inter_node=link)
    b = 2**16

    def ring(n, lat):  # all-reduce over n ranks
        return 2 * (n - 1) / n * b / 1e9 + 2 * (n - 1) * lat

    cm = CommModel(one_node, (2, 2))
    assert cm.ranges("all_reduce", 0) == "all_reduce/2x2" and cm.ranges("all_reduce", 1) == "all_reduce/2x1"
    assert cm.time(Collective.ALL_REDUCE, b, 0) == approx(ring(2, 2e-3))
    assert cm.time(Collective.ALL_REDUCE, b, 1) == approx(ring(2, 5e-3))
    assert cm.queued_all_reduce_time(b, 1) == approx(ring(2, 3e-4))
    assert cm.queued_all_reduce_time(b, 0) == approx(ring(2, 1e-4))  # 2x2 queued: not measured
    assert cm.time(Collective.ALL_GATHER, b, 1) == approx(b / 2 / 1e9 + 1e-3)  # no group entry: the link's
    whole = CommModel(one_node, (4,))
    assert whole.ranges("all_reduce", 0) == "all_reduce"
    assert whole.time(Collective.ALL_REDUCE, b, 0) == approx(ring(4, 1e-3))
    # two nodes of two: the outer axis of (2, 2) crosses nodes (the inter-node link, no group figures)
    two_nodes = ClusterSpec.preset("cpu", nodes=2, devices_per_node=2).with_overrides(
        intra_node=link, inter_node=link
    )
    cross = CommModel(two_nodes, (2, 2))
    assert cross.ranges("all_reduce", 0) == "all_reduce" and cross.ranges("all_reduce", 1) == "all_reduce/2x1"


def test_no_tree_inside_a_node_when_both_links_are_one_object():
    """A one-node calibration gives the intra- and inter-node links the same figures (one object):
    an axis inside the node still rings, as it was measured (a tree's 2 log2(n) latencies are not)."""
    link = LinkSpec(1e11, 1e-3)
    same = ClusterSpec.preset("cpu", devices_per_node=4).with_overrides(intra_node=link, inter_node=link)
    assert CommModel(same, (4,)).time(Collective.ALL_REDUCE, 1e3, 0) == approx(2 * 3 / 4 * 1e3 / 1e11 + 6e-3)


def test_gloo_reduce_scatter_is_priced_as_the_all_reduce_it_runs():
    """CPU ranks' transport (gloo) has no reduce-scatter: codegen runs an all-reduce and a slice, and
    a reduce-scatter is priced as that all-reduce (twice the ring's), unless the link has figures
    measured for a reduce-scatter (``autopar calibrate`` measures it as codegen runs it). GPUs' NCCL
    keeps the ring's price."""
    b = 65536.0
    for name in ("cpu", "h100-sxm"):
        cluster = ClusterSpec.preset(name, devices_per_node=4).with_overrides(
            intra_node=INTRA, inter_node=INTER
        )
        m = CommModel(cluster, (4,))
        ring = collective_time(Collective.REDUCE_SCATTER, b, 4, INTRA)
        all_reduce = collective_time(Collective.ALL_REDUCE, b, 4, INTRA)
        assert all_reduce == approx(2 * ring)
        want = all_reduce if name == "cpu" else ring
        assert m.time(Collective.REDUCE_SCATTER, b, 0) == approx(want), name
        assert m.time(Collective.ALL_GATHER, b, 0) == approx(ring), name  # gloo gathers as a ring does
    measured = LinkSpec(bandwidth=1e11, latency=1e-6, ranges=(("reduce_scatter", 1e9, 2e10, 5e-6),))
    cpu = ClusterSpec.preset("cpu", devices_per_node=4).with_overrides(
        intra_node=measured, inter_node=measured
    )
    assert CommModel(cpu, (4,)).time(Collective.REDUCE_SCATTER, b, 0) == approx(3 / 4 * b / 2e10 + 3 * 5e-6)
