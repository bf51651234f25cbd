"""More models: a plain-torch PaLM (multi-query attention, RoPE, SwiGLU, parallel block), Hugging Face
T5 (encoder-decoder, relative position buckets), ViT (conv2d patch embedding) and the Megatron-style
GPT-3 of ``autopar.examples.gpt3`` (OPT: per-head Q/K/V, one-op GELU) on 2 and 4 gloo processes.

2 ranks: DP, TP and the solver's plan; 4 ranks: TP on mesh (4,), the solver's plan on mesh (2, 2). Planned, run and compared with the single-device model by tests/harness.py.

Fast single-process tests check the new sharding rules against the dense op (local pieces in,
local piece out) and that the PaLM graph has a rule for every op.
"""

from __future__ import annotations

import collections
import operator

import pytest
import torch
from harness import FREE_LINK, SQUEEZED, D, T, check_run, reference, run_world

import autopar
from autopar.examples import gpt2_tiny, gpt3, palm_tiny, t5_tiny, vit_tiny
from autopar.models.palm import PalmOutput
from autopar.passes.rules import RULES
from autopar.passes.trace import trace
from autopar.tools.validate import check_node, node_strategies, one_node_graph

pytestmark = pytest.mark.slow

MODELS = {
    "palm": lambda: palm_tiny(batch=4, seq=16, hidden=32, heads=4, vocab=128),
    "t5": lambda: t5_tiny(batch=4, seq=16, hidden=32, heads=4, vocab=128),
    "vit": lambda: vit_tiny(batch=4, hidden=32, heads=4),
    "gpt3": lambda: gpt3(layers=2, hidden=32, heads=4, vocab=128, batch=4, seq=16, dtype="float32"),
}
# world size -> mode -> (mesh shape, axis roles[, how]); roles None lets the solver choose every
# placement, in a setting where parallelism pays on a toy model (tests/harness.py).
# The sizes above divide 4 wherever a 4-way plan shards them (batch 4, 4 heads, hidden 32, vocab 128).
PLANS = {
    2: {"dp": ((2,), (D,)), "tp": ((2,), (T,)), "auto": ((2,), None, SQUEEZED)},
    4: {
        "tp": ((4,), (T,)),
        "auto_2x2": ((2, 2), None, FREE_LINK),
    },  # data parallel: at 2 and in test_data_role
}


def build(name):
    return MODELS[name]()


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_world(build, MODELS, PLANS[2], 2, tmp_path_factory.mktemp("plans_more2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_world(build, MODELS, PLANS[4], 4, tmp_path_factory.mktemp("plans_more4"))


@pytest.fixture(scope="module")
def references():
    return {name: reference(build, name) for name in MODELS}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode", list(PLANS[2]))
def test_world2(world2, references, name, mode):
    check_run(world2, references, name, mode, PLANS[2])


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode", list(PLANS[4]))
def test_world4(world4, references, name, mode):
    check_run(world4, references, name, mode, PLANS[4])


def test_palm_tp_shards_query_heads_and_keeps_one_kv_head(world2):
    """Multi-query attention under TP: the single K/V head cannot be split over heads, so K and V
    enter attention replicated (gathered) while q may be head-sharded; the weights are all sharded."""
    plans, _ = world2
    plan = plans[("palm", "tp")]
    out = {d.target: d.output for d in plan.decisions if d.role == "param"}
    attn = [d for d in plan.decisions if d.op == "aten.scaled_dot_product_attention.default"]
    assert len(attn) == 2
    for layer, d in enumerate(attn):
        q, k, v = d.inputs[:3]
        assert q in ("S(0)", "S(1)", "R") and (k, v) in (("R", "R"), ("S(0)", "S(0)")), d
        assert (k, v) == ("R", "R") or q == "S(0)"  # batch-split attention needs no K/V gather
        for w in ("q_proj", "k_proj", "v_proj"):
            assert out[f"blocks.{layer}.attn.{w}.weight"] != "R"


# ------------------------------------------------------------------------------------------------
# fast, single process
# ------------------------------------------------------------------------------------------------

# Ops of the PaLM graph that may stay without a sharding rule. None today: every op has a rule.
# (``operator.getitem`` is not an op: it takes its producer's placement, see strategies.py.)
PALM_REPLICATE_ONLY: set = set()


def test_gpt3_splits_heads_over_a_tensor_axis_without_reshuffling():
    """What ``examples.gpt3`` is for: its per-head projections let a tensor axis split attention by
    heads with no collective at the head views; GPT-2's [q | k | v] projection leaves attention
    whole on every rank, its views resharded (what bench_published prices Megatron's GPT with)."""
    cluster = autopar.ClusterSpec.preset("h100-sxm", devices_per_node=2)

    def attention_and_views(model, inputs):
        plan = autopar.plan(model, cluster, inputs, mesh_shape=(2,), axis_roles=(T,), kernels="none")
        sdpa = [d for d in plan.decisions if "scaled_dot_product" in d.op]
        views = [  # attention's head views (the loss's flattening of the logits is not one)
            d
            for d in plan.decisions
            if any(k in d.op for k in (".view", ".transpose", ".reshape", ".split")) and "attn" in d.module
        ]
        return sdpa, sum(d.comm_s for d in views)

    sdpa, view_comm = attention_and_views(*gpt3(layers=2, hidden=32, heads=4, vocab=128, batch=4, seq=16))
    assert sdpa and all(d.inputs[:3] == ("S(1)",) * 3 for d in sdpa)  # [batch, heads, seq, dim]: heads split
    assert view_comm == 0.0
    sdpa2, view_comm2 = attention_and_views(*gpt2_tiny(batch=4, seq=16, layers=2, hidden=32, vocab=128))
    assert all(d.inputs[:3] == ("R",) * 3 for d in sdpa2) and view_comm2 > 0


def test_palm_traces_with_a_rule_for_every_op():
    model, inputs = palm_tiny()
    out = model(**inputs)
    assert isinstance(out, PalmOutput) and out.loss.ndim == 0 and out.logits.shape == (4, 16, 256)
    tg = trace(model, inputs)
    assert tg.tracer == "torch.export"
    ops = collections.Counter(
        n.target for n in tg.graph.nodes if n.op == "call_function" and n.target is not operator.getitem
    )
    assert ops[torch.ops.aten.scaled_dot_product_attention.default] == 2
    missing = {op for op in ops if op not in RULES} - PALM_REPLICATE_ONLY
    assert not missing, f"PaLM ops without a sharding rule: {sorted(map(str, missing))}"
    # multi-query attention: one K/V head, enable_gqa kept in the graph
    sdpa = next(n for n in tg.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    assert sdpa.args[1].meta["val"].shape[1] == 1 and sdpa.kwargs.get("enable_gqa") is True


def _check_rule(op, args: tuple, kwargs: dict | None = None, n: int = 2) -> int:
    """Every strategy of ``op`` on a mesh of ``n``: the validator runs the real generated local code
    (lowerings and collectives included) on every simulated rank, forward and backward."""
    node, values = one_node_graph(op, args, kwargs or {})
    strategies = node_strategies(node, (n,))
    assert len(strategies) > 1, f"{op}: no sharded option"
    bad = [str(r) for r in check_node(node, (n,), values, strategies) if not r.ok]
    assert not bad, f"{op}:\n" + "\n".join(bad)
    return len(strategies)


def test_new_rules_match_the_dense_op():
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(1)

    def r(*s):
        return torch.randn(*s, generator=g)

    x, w, b = r(4, 6, 8, 8), r(4, 6, 3, 3), r(4)
    # batch, output channels, input channels (Partial), Partial input, and all-Replicate
    assert _check_rule(aten.conv2d.default, (x, w, b, [1, 1], [1, 1], [1, 1], 1)) == 5
    assert _check_rule(aten.conv2d.default, (x, w, None, [2, 2], [0, 0])) == 5
    _check_rule(aten.conv2d.default, (x, r(4, 3, 3, 3), b, [1, 1], [0, 0], [1, 1], 2))  # groups: batch only
    _check_rule(aten.conv1d.default, (r(2, 4, 10), r(6, 4, 3), r(6)))
    _check_rule(aten.pad.default, (r(4, 6, 8), [0, 2, 1, 0]))  # pads dims 2 and 1: dim 0 only
    _check_rule(aten.pad.default, (r(4, 6, 8), [1, 1], "reflect"))
    _check_rule(aten.pad.default, (torch.randint(0, 9, (4, 6)), [0, 1], "constant", -100.0))
    _check_rule(aten.constant_pad_nd.default, (r(4, 6, 8), [0, 2]))
    _check_rule(aten.flatten.using_ints, (r(4, 6, 2, 8), 1, 2))
    _check_rule(aten.flatten.using_ints, (r(4, 6, 2, 8), 2, -1))
    i1, i2 = torch.randint(-5, 5, (4, 6), generator=g), torch.randint(-5, 5, (6,), generator=g)
    _check_rule(aten.min.other, (i1, i2))
    _check_rule(aten.max.other, (i1, i2))
    cond = r(4, 1, 6, 6) > 0
    _check_rule(aten.where.ScalarOther, (cond, r(1, 4, 6, 6), -1e9))
    _check_rule(aten.where.ScalarSelf, (cond, 0.5, r(4, 4, 6, 6)))


def test_existing_rules_used_by_these_models_match_the_dense_op():
    """The rules PaLM leans on: RoPE's chunk/cat and multi-query attention (one K/V head)."""
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(2)
    q, kv = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 1, 8, 8, generator=g)
    _check_rule(
        aten.scaled_dot_product_attention.default, (q, kv, kv), {"is_causal": True, "enable_gqa": True}
    )
    _check_rule(aten.chunk.default, (q, 2, -1))
    _check_rule(aten.cat.default, ([q, q], -1))
