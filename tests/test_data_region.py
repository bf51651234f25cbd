"""Data-parallel regions (``passes/data_region.py``): ops that each mix the batch's rows (a sort of
every token, a gather in expert order, a grouped matmul) but whose region, run on one rank's rows
alone, gives exactly that rank's rows of the whole batch's result, run on each rank's rows under
forced data parallelism; a region whose outputs are not per row is refused, and the error names the
op that prevents the role."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import D, check_run, reference, run_world, sgd_losses
from hypothesis import assume, given
from hypothesis import strategies as st
from rules_check import SETTINGS

import autopar
from autopar.errors import NoPlanFitsError
from autopar.options import AxisRole
from autopar.passes.analyze import analyze
from autopar.passes.data_region import DataRegion, find_region
from autopar.passes.local_rows import trace_rows
from autopar.passes.strategies import build_strategies
from autopar.passes.trace import trace
from autopar.placement import OwnRows, via_from_str

BATCH, SEQ, VOCAB = 4, 16, 128


class Routed(torch.nn.Module):
    """Token-choice routing as a mixture of experts does it, in plain torch: each token's expert by
    its gate, the tokens sorted by expert (``argsort`` of every token), each run through its
    expert's weight, then scattered back to their places (``index_put_``), an MSE loss. With
    ``mix``, the results stay in expert order: row ``i`` of the output is then some other sample's."""

    def __init__(self, hidden: int = 8, experts: int = 4, mix: bool = False):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts)
        self.experts = torch.nn.Parameter(torch.randn(experts, hidden, hidden) / hidden**0.5)
        self.head = torch.nn.Linear(hidden, 1)
        self.mix = mix

    def forward(self, x, y):
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        expert = self.gate(tokens).argmax(-1)
        order = expert.argsort()
        done = torch.bmm(tokens[order].unsqueeze(1), self.experts[expert[order]]).squeeze(1)
        if not self.mix:
            back = torch.empty_like(order)
            back[order] = torch.arange(order.numel())
            done = done[back]
        out = self.head(torch.tanh(done.view(b, s, h) + x)).squeeze(-1)
        return F.mse_loss(out, y)


def _routed(batch: int = 4, seq: int = 3, mix: bool = False):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    return Routed(mix=mix), (
        torch.randn(batch, seq, 8, generator=gen),
        torch.randn(batch, seq, generator=gen),
    )


def _region(model, inputs, parts: int) -> DataRegion | str:
    tg = trace(model, inputs)
    infos = analyze(tg)
    rows = trace_rows(model, inputs, tg, parts)
    assert not isinstance(rows, str), rows
    return find_region(tg, rows, infos, build_strategies(tg, infos, (parts,), (AxisRole.DATA,)))


def _cpu(world: int) -> autopar.ClusterSpec:
    return autopar.ClusterSpec.preset("cpu", devices_per_node=world)


@given(
    batch=st.sampled_from([2, 4, 8]), seq=st.integers(1, 4), parts=st.sampled_from([2, 4]), mix=st.booleans()
)
@SETTINGS
def test_a_region_is_taken_only_where_each_ranks_rows_give_its_rows(batch, seq, parts, mix):
    """Routed per token, the region around the sort holds on any batch the ranks divide; left in
    expert order, it never does (each rank's sorted tokens are not its rows of the whole sort), and
    the refusal names the op."""
    assume(batch % parts == 0 and (batch // parts) * seq > 1)  # a batch of one token traces another graph
    got = _region(*_routed(batch, seq, mix), parts)
    if mix:
        assert isinstance(got, str) and "aten.argsort" in got, got
    else:
        assert isinstance(got, DataRegion), got
        ops = {n.rstrip("_0123456789") for n in got.nodes}
        assert {"argsort", "index_put"} <= ops, ops  # the expert matmul (bmm) has a rule of its own
        assert all(o.via is OwnRows.LOCAL for o in got.options.values())


def test_forced_data_parallelism_on_a_region_that_mixes_samples_names_the_op():
    model, inputs = _routed(mix=True)
    with pytest.raises(
        NoPlanFitsError, match=r"aten\.argsort\.default \(node argsort\).*as a data-parallel region"
    ):
        autopar.plan(model, _cpu(2), inputs, mesh_shape=(2,), axis_roles=(D,))


def test_a_region_too_large_to_check_is_refused_before_it_runs(monkeypatch):
    """The check's memory is counted from the traced values before anything runs (a model planned
    on meta would have its experts made for it): past the budget the region is refused, saying
    so; the automatic search never looks for a region (it has other layouts)."""
    import autopar.passes.data_region as dr

    model, inputs = _routed()
    said: list[str] = []
    auto = autopar.plan(model, _cpu(2), inputs, progress=said.append)
    assert not any("data region" in m for m in said)
    assert not any(OwnRows.LOCAL in via_from_str(d.via) for d in auto.decisions)
    monkeypatch.setattr(dr, "CHECK_BUDGET_BYTES", 64)
    ran = []
    monkeypatch.setattr(dr, "_subgraph", lambda *a, **k: ran.append(1))
    with pytest.raises(
        NoPlanFitsError, match=r"as a data-parallel region: checking the region .* would hold"
    ):
        autopar.plan(model, _cpu(2), inputs, mesh_shape=(2,), axis_roles=(D,))
    assert not ran


def test_a_routed_region_is_planned_with_its_ops_on_each_ranks_rows():
    """The plan keeps the batch split and the weights whole; the ops of the region say so (via
    ``own_rows``), nothing is gathered on the data axis."""
    model, inputs = _routed()
    plan = autopar.plan(model, _cpu(2), inputs, mesh_shape=(2,), axis_roles=(D,))
    own = [d for d in plan.decisions if OwnRows.LOCAL in via_from_str(d.via)]
    assert {d.op for d in own} >= {"aten.argsort.default", "aten.index_put_.default"}
    assert all(d.output != "R" or d.shape in ((), (4,)) for d in own)


def _routed_rank(rank, world, path):
    model, (x, y) = _routed()
    pm = autopar.autoparallelize(model, _cpu(world), (x, y), plan=path)
    return sgd_losses(pm, x, y), pm.full_state_dict()


@pytest.mark.slow
def test_a_routed_region_trains_as_one_device(tmp_path):
    from autopar.launch import run_on_ranks

    model, (x, y) = _routed()
    path = tmp_path / "dp.json"
    autopar.plan(model, _cpu(2), (x, y), mesh_shape=(2,), axis_roles=(D,)).save(path)
    ref = sgd_losses(model, x, y)
    for losses, state in run_on_ranks(_routed_rank, 2, str(path)):
        for a, b in zip(losses, ref):
            torch.testing.assert_close(a, b)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)


# -- Qwen3-MoE, as benchmarks/bench_any_model.py builds it --------------------------------------------


def _qwen3_moe():
    tf = pytest.importorskip("transformers")
    cfg = tf.Qwen3MoeConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, decoder_sparse_step=1, attention_dropout=0.0, vocab_size=VOCAB,
        use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    # no router loss (it sums over every token) and no capacity: the experts' region is per token
    assert not cfg.output_router_logits
    return tf.Qwen3MoeForCausalLM(cfg)


def _deepseek_v3():
    """DeepSeek-V3 as a tiny config builds it: MLA attention, one dense layer, then routed experts
    with a shared one; grouped routing over one group (``n_group=1``: a ``scatter_`` over a dim of
    size 1) and top-k weights normalized in place after a ``gather``."""
    tf = pytest.importorskip("transformers")
    cfg = tf.DeepseekV3Config(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
        max_position_embeddings=64, vocab_size=VOCAB, attention_dropout=0.0, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return tf.DeepseekV3ForCausalLM(cfg)


def build(name):
    torch.manual_seed(0)  # every rank and the reference build the same weights
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}[name](), {"input_ids": ids, "labels": ids}


PLANS = {2: {"dp": ((2,), (D,))}, 4: {"dp": ((4,), (D,))}}


@pytest.fixture(scope="module")
def references():
    return {"qwen3_moe": reference(build, "qwen3_moe")}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_qwen3_moe_trains_data_parallel_as_one_device(world, references, tmp_path):
    """Forced data parallelism on Qwen3-MoE (its experts, one op, split on the tokens): loss and logits of two
    SGD steps and every weight after them equal the single-device model's on every rank (on 4
    ranks each holds one row, which Hugging Face traces another way: the region's sizes are read
    off a trace on two rows)."""
    result = run_world(build, ["qwen3_moe"], PLANS[world], world, tmp_path)
    check_run(result, references, "qwen3_moe", "dp", PLANS[world])
    plan = result[0][("qwen3_moe", "dp")]
    # the experts' region is one op (passes/experts.py) with a rule of its own: its tokens split,
    # no region needed
    moe = [d for d in plan.decisions if d.op == "autopar.moe_experts.default"]
    assert moe and all(d.output == "S(0)" and not d.via for d in moe), moe


class OneGroup(Routed):
    """``Routed`` with DeepSeek-V3's group mask over one group: each token's best group (there is
    one) scattered into a mask in place (``scatter_add_``, a region op) before its expert is chosen."""

    def forward(self, x, y):
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        scores = self.gate(tokens)
        group = scores.amax(-1, keepdim=True)
        # scatter_add_ (no rule: a region op), where DeepSeek-V3 has scatter_ (split on its rows by
        # its own rule, rules/shape.py): the group index enters the region from outside
        mask = torch.zeros_like(group).scatter_add_(1, group.topk(1, dim=-1)[1], torch.ones_like(group))
        expert = (scores * mask).argmax(-1)
        order = expert.argsort()
        done = torch.bmm(tokens[order].unsqueeze(1), self.experts[expert[order]]).squeeze(1)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel())
        out = self.head(torch.tanh(done[back].view(b, s, h) + x)).squeeze(-1)
        return F.mse_loss(out, y)


IN_PLACE_CHAIN_OPS = {"aten.new_empty.default", "aten.copy_.default", "aten.scatter_.value"}


def test_the_region_check_draws_indices_below_the_dim_they_index():
    """The group index enters the region from outside; drawn in [0, 2), it would scatter out of
    the one group's range and the region would be refused as not running."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    inputs = (torch.randn(4, 3, 8, generator=gen), torch.randn(4, 3, generator=gen))
    got = _region(OneGroup(), inputs, 2)
    assert isinstance(got, DataRegion), got
    assert any(n.startswith("scatter_add_") for n in got.nodes), sorted(got.nodes)


@pytest.mark.slow
def test_deepseek_v3_trains_data_parallel_as_one_device(tmp_path):
    """Forced data parallelism on DeepSeek-V3 with one routing group: the router's gather and its
    in-place normalization keep the batch split, and so do the experts (one op) on the rank's tokens; loss and logits of two SGD steps and every weight after them
    equal the single-device model's on both ranks."""
    refs = {"deepseek_v3": reference(build, "deepseek_v3")}
    result = run_world(build, ["deepseek_v3"], PLANS[2], 2, tmp_path)
    check_run(result, refs, "deepseek_v3", "dp", PLANS[2])
    plan = result[0][("deepseek_v3", "dp")]
    split = {d.op: d.output for d in plan.decisions if OwnRows.LOCAL not in via_from_str(d.via)}
    assert split.get("aten.gather.default") == split.get("aten.div_.Tensor") == "S(0)", split
    assert split.get("autopar.moe_experts.default") == "S(0)", split
    # MLA fills its queries into a new_empty in place (slice + copy_) and the router its group mask
    # (zeros_like + scatter_): both on the rank's rows, the writes landing in the split buffers
    written = {d.op for d in plan.decisions if d.op in IN_PLACE_CHAIN_OPS and d.output != "S(0)"}
    assert not written, [d for d in plan.decisions if d.op in written]
