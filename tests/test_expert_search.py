"""The search chooses expert parallelism where it pays (``passes/candidates.py:_with_experts``).

A Mixtral-shaped model on 8 H100 (meta device, priced only): the search's own plan is no slower than
the best of the layouts it has to choose between for the experts, each forced on the same mesh
(experts whole on a data axis, experts split by all-to-all on an expert axis); here the all-to-all
layout is the faster of the two, and the search's plan splits the experts by it."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar import AxisRole, Outputs, Precision
from autopar.placement import ExpertDispatch, R, Shard, via_from_str
from autopar.report import render_report

tf = pytest.importorskip("transformers")

MOE = "autopar.moe_experts.default"


def _model():
    cfg = tf.MixtralConfig(
        num_hidden_layers=2, hidden_size=1024, intermediate_size=3584, num_attention_heads=16,
        num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=8192, use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = tf.MixtralForCausalLM(cfg)
    ids = torch.zeros(16, 2048, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def _plan(**more):
    model, batch = _model()
    cluster = autopar.ClusterSpec.preset("h100-sxm", 1, 8)
    return autopar.plan(
        model, cluster, batch, outputs=Outputs.LOSS, precision=Precision.BF16, pipeline_stages=1, **more
    )


def test_the_search_picks_the_faster_expert_layout():
    data = _plan(mesh_shape=(8,), axis_roles=(AxisRole.DATA,))
    expert = _plan(mesh_shape=(8,), axis_roles=(AxisRole.EXPERT,))
    free = _plan()
    best = min(data.predicted.step_time_s, expert.predicted.step_time_s)
    assert free.predicted.step_time_s <= best * (1 + 1e-9)
    moe = [d for d in expert.decisions if d.op == MOE]
    assert moe and all(via_from_str(d.via)[0] is ExpertDispatch.ALL_TO_ALL for d in moe)
    # here the experts' weights dominate: moving the tokens to them (2 x 32k pairs of 1024 bf16
    # each way) costs less than the replicated experts' gradient all-reduce
    assert expert.predicted.step_time_s < data.predicted.step_time_s
    chosen = [d for d in free.decisions if d.op == MOE]
    assert chosen and all(ExpertDispatch.ALL_TO_ALL in via_from_str(d.via) for d in chosen), free.summary()


def test_the_dispatch_moves_the_rows_in_the_dtype_the_experts_run_in():
    """Under bf16 mixed precision the experts run in bf16 (``kernels/moe.py:autocast_operands``):
    the dispatch's rows travel in it, half the bytes of the fp32 trace's (the plan in fp32 moves
    them in fp32); the counts (int64) are the same in both."""

    def moe_calls(precision):
        model, batch = _model()
        cluster = autopar.ClusterSpec.preset("h100-sxm", 1, 8)
        plan = autopar.plan(
            model, cluster, batch, outputs=Outputs.LOSS, precision=precision, pipeline_stages=1,
            mesh_shape=(8,), axis_roles=(AxisRole.EXPERT,),
        )  # fmt: skip
        d = next(d for d in plan.decisions if d.op == MOE)
        return [c.nbytes for c in d.collectives if c.kind.value == "all_to_all"]

    half, full = moe_calls(Precision.BF16), moe_calls(Precision.PARAM)
    assert len(half) == len(full) == 5
    assert half[0] == full[0] == 8 * 8  # the counts: one int64 per expert
    # the pairs: 16 x 2048 tokens / 8 ranks x top 2 x 1024, in 2 bytes against 4
    assert half[1:] == [16 * 2048 // 8 * 2 * 1024 * 2] * 4, half
    assert full[1:] == [2 * b for b in half[1:]], full


def test_a_skewed_routing_is_priced_on_the_busiest_rank_and_recorded():
    """``expert_skew``: under expert parallelism the busiest rank's all-to-all bytes and expert work
    grow by the skew (the MoE op's own seconds by exactly it, its bytes too), the plan records it
    and says so, and it survives a JSON round trip; a skew below 1 is refused."""
    forced = dict(mesh_shape=(8,), axis_roles=(AxisRole.EXPERT,))
    even, skewed = _plan(**forced), _plan(expert_skew=1.5, **forced)
    assert (even.expert_skew, skewed.expert_skew) == (1.0, 1.5)
    assert "busiest rank 1.5x" in skewed.summary() and "routing priced balanced" in even.summary()
    assert autopar.Plan.from_dict(skewed.to_dict()).expert_skew == 1.5
    for a, b in zip((d for d in even.decisions if d.op == MOE), (d for d in skewed.decisions if d.op == MOE)):
        assert b.compute_s == pytest.approx(1.5 * a.compute_s, rel=1e-9)
        rows = [c for c in a.collectives if c.nbytes > 1024]
        assert [1.5 * c.nbytes for c in rows] == pytest.approx(
            [c.nbytes for c in b.collectives if c.nbytes > 1024]
        )
    assert skewed.predicted.step_time_s > even.predicted.step_time_s
    html = render_report(skewed)  # the report shows the expert layout and the skew priced
    assert "expert parallel" in html and "experts of 2 of 2 MoE layers split (by all-to-all)" in html
    assert (
        "busiest rank&#x27;s share of routed pairs" in html or "busiest rank's share of routed pairs" in html
    )
    with pytest.raises(autopar.SearchOptionsError, match="expert_skew"):
        autopar.SearchOptions(expert_skew=0.5)


def test_the_experts_grouped_gemms_are_priced_as_gemms_of_their_rows_per_expert():
    """The MoE op's GEMM efficiency is that of one expert's GEMM: its balanced share of the routed
    rows against [H, F] (``cost_model/compute.py``): small shares price like skinny GEMMs."""
    from autopar.cost_model.compute import GEMM_OPS, gemm_min_dim

    assert MOE in GEMM_OPS
    # 4096 tokens, top 2, 8 experts of [F=1024, H=512]: 1024 rows per expert
    shapes = [(4096, 512), (4096, 2), (4096, 2), (8, 1024, 512), (8, 512, 1024)]
    assert gemm_min_dim(MOE, shapes) == 512
    shapes[0], shapes[1], shapes[2] = (256, 512), (256, 2), (256, 2)  # 64 rows per expert
    assert gemm_min_dim(MOE, shapes) == 64


def test_zero_over_two_axes_that_split_the_batch_is_planned_over_both():
    """Expert parallelism beside data parallelism on separate axes splits the batch on both
    (``tests/test_expert_data_parallel_dist.py``). ZeRO 1, 2 and 3 forced with such roles shard over
    both axes (``tests/test_expert_data_zero_dist.py`` trains them), and the memory priced follows
    what each engine shards (``passes/trades.py:zero_size``): ZeRO-1 a parameter over every data
    axis it is whole on (an expert split on the expert axis over the data axis), FSDP2 only what is
    whole on both (the experts left whole)."""
    from autopar.passes.trades import zero_size
    from autopar.trades import Trades, ZeroStage

    for roles in ((AxisRole.DATA, AxisRole.EXPERT), (AxisRole.EXPERT, AxisRole.DATA), (AxisRole.DATA,) * 2):
        for zero in (1, 2, 3):
            autopar.SearchOptions(mesh_shape=(2, 2), axis_roles=roles, zero_stage=zero)
    dense, expert, mesh = (R, R), (R, Shard(0)), (2, 4)
    one, fsdp = (Trades(zero_stage=z, data_axes=(0, 1)) for z in (ZeroStage.OPTIMIZER, ZeroStage.PARAMETERS))
    assert (zero_size(dense, mesh, one), zero_size(expert, mesh, one)) == (8, 2)
    assert (zero_size(dense, mesh, fsdp), zero_size(expert, mesh, fsdp)) == (8, 1)
    single = Trades(zero_stage=ZeroStage.PARAMETERS, data_axes=(0,))
    assert (zero_size(dense, mesh, single), zero_size(expert, mesh, single)) == (2, 2)


def test_expert_parallel_beside_data_parallel_is_a_candidate_and_can_pay():
    """The search tries each two-axis mesh of an MoE model also with axis 0 data parallel and axis 1
    expert parallel (``passes/candidates.py``); on 2 nodes of 4 H100 that layout (the experts split
    inside a node, whole across the two) is priced below data parallel over all 8 GPUs (whose
    experts' gradients are all-reduced across nodes) and below expert parallel over all 8 by the
    flat all-to-all (every pair's row across nodes), but above expert parallel over all 8
    dispatched once per node (``ExpertDispatch.NODE_ALL_TO_ALL``: 1.57 rows a token cross the
    nodes, not 2, and no expert's gradient does)."""
    from autopar.options import SearchOptions
    from autopar.passes.candidates import spmd_runs

    cluster = autopar.ClusterSpec.preset("h100-sxm", 2, 4)
    runs = [r for r, _ in spmd_runs(cluster, SearchOptions(), experts=True)]
    assert any(r.mesh == (2, 4) and r.roles == (AxisRole.DATA, AxisRole.EXPERT) for r in runs)
    assert not any(r.roles and AxisRole.EXPERT in r.roles[1:] for r, _ in spmd_runs(cluster, SearchOptions()))
    model, _ = _model()
    # 32 sequences: the tokens the all-to-all moves against the experts' gradients the data axis
    # reduces (the dispatch's bf16 rows: 16 sequences take EP8 across nodes, 64 data parallelism)
    ids = torch.zeros(32, 2048, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids}

    def step(mesh, roles):
        plan = autopar.plan(
            model, cluster, batch, outputs=Outputs.LOSS, precision=Precision.BF16, pipeline_stages=1,
            mesh_shape=mesh, axis_roles=roles,
        )  # fmt: skip
        return plan

    beside = step((2, 4), (AxisRole.DATA, AxisRole.EXPERT))
    for d in (d for d in beside.decisions if d.op == MOE):
        assert via_from_str(d.via)[1] is ExpertDispatch.ALL_TO_ALL and d.inputs[0] == "S(0),S(0)", d
    assert beside.predicted.step_time_s < step((8,), (AxisRole.DATA,)).predicted.step_time_s
    over_nodes = step((8,), (AxisRole.EXPERT,))
    moe = [d for d in over_nodes.decisions if d.op == MOE]
    assert moe and all(via_from_str(d.via)[0] is ExpertDispatch.NODE_ALL_TO_ALL for d in moe)
    assert over_nodes.predicted.step_time_s < beside.predicted.step_time_s
    # the flat dispatch of the same plan: each MoE op's collectives priced as the flat all-to-all's
    from autopar.cost_model.comm import CommModel
    from autopar.reshard import Collective

    comm = CommModel(cluster, (8,))
    tokens = 32 * 2048 // 8  # a rank's
    pairs = tokens * 2 * 1024 * 2  # top 2, hidden 1024, bf16
    flat = comm.time(Collective.ALL_TO_ALL, 8 * 8, 0) + 4 * comm.time(Collective.ALL_TO_ALL, pairs, 0)
    for d in moe:
        inside = sum(
            comm.time(c.kind, c.nbytes, c.axis, c.group) for c in d.collectives if c.site.value == "inside"
        )
        saved = flat - inside
        assert saved > 0
        assert beside.predicted.step_time_s < over_nodes.predicted.step_time_s + len(moe) * saved
