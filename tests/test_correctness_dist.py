"""Parallel runs match the single-device model: GPT-2, Llama and BERT on 2 and 4 gloo processes.

Plans forced to data, tensor and sequence parallelism, DP x TP on a 2x2 mesh, and the solver's
own choice (see tests/harness.py for how they are planned, run and compared).
"""

from __future__ import annotations

import dataclasses

import pytest
from harness import FREE_LINK, SQUEEZED, D, S, T, check_run, code_of, reference, run_world
from torch.distributed.tensor.placement_types import Shard

from autopar.codegen.lower import mangle
from autopar.examples import bert_tiny, gpt2_tiny, llama_tiny
from autopar.passes.analyze import analyze
from autopar.passes.strategies import build_strategies
from autopar.passes.trace import trace
from autopar.placement import R, spec_to_str
from autopar.reshard import Collective, Phase

pytestmark = pytest.mark.slow

MODELS = {
    "gpt2": lambda: gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128),
    "llama": lambda: llama_tiny(batch=4, seq=16, hidden=32, vocab=128),
    "bert": lambda: bert_tiny(batch=4, seq=16, hidden=32, vocab=128),
}
# world size -> mode -> (mesh shape, axis roles[, how]); roles None lets the solver choose every
# placement, in a setting where parallelism pays on a toy model (tests/harness.py)
PLANS = {
    2: {"dp": ((2,), (D,)), "tp": ((2,), (T,)), "sp": ((2,), (S,)), "auto": ((2,), None, SQUEEZED)},
    4: {
        # data parallelism on 4 ranks is dp_tp_2x2's outer axis and test_data_role's
        "tp": ((4,), (T,)),
        "dp_tp_2x2": ((2, 2), (D, T)),
        "auto_2x2": ((2, 2), None, FREE_LINK),
    },
}


def build(name):
    return MODELS[name]()


def _with_sequence_parallel_attention(mode, plan, model, inputs):
    """Every strategy the rules offer must run correctly, chosen or not: in the SP plans, put each
    attention node on its query-rows strategy (keys/values replicated); codegen reshards around it."""
    if mode != "sp":
        return plan
    tg = trace(model, inputs)
    allowed = build_strategies(tg, analyze(tg), plan.mesh_shape)
    decisions = []
    for d in plan.decisions:
        if d.op == "aten.scaled_dot_product_attention.default":
            s = next(s for s in allowed[d.name].strategies if s.ins[0] == (Shard(2),) and s.ins[1] == (R,))
            d = dataclasses.replace(d, output=spec_to_str(s.out), inputs=tuple(spec_to_str(x) for x in s.ins))
        decisions.append(d)
    return dataclasses.replace(plan, decisions=tuple(decisions))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_world(
        build, MODELS, PLANS[2], 2, tmp_path_factory.mktemp("plans2"), _with_sequence_parallel_attention
    )


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_world(build, MODELS, PLANS[4], 4, tmp_path_factory.mktemp("plans4"))


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


def test_tensor_parallel_plans_communicate_activations(world2):
    """A TP plan that gathered every weight before use would be FSDP in disguise: check it is not."""
    plans, _ = world2
    for name in MODELS:
        plan = plans[(name, "tp")]
        colls = [c for d in plan.decisions for c in d.collectives]
        # activations are reduced: all-reduce (Megatron TP) or reduce-scatter (Megatron sequence parallelism)
        reductions = (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER)
        assert any(c.kind in reductions and c.phase is Phase.FORWARD for c in colls), (
            f"{name}: no forward reduction of activations in the TP plan"
        )
        code = code_of(world2, name, "tp")
        weights = [mangle(d.target) for d in plan.decisions if d.role == "param" and len(d.shape) >= 2]
        assert weights and all(w in code for w in weights)
        gathered = [w for w in weights if f"all_gather({w}," in code]
        assert not gathered, f"{name}: TP plan gathers weights {gathered}"


def test_sequence_parallel_plans_split_attention_over_query_rows(world2):
    """Attention on this rank's query rows against gathered keys/values (forced into the SP plans by
    _with_sequence_parallel_attention; their outputs and trained weights matched above)."""
    plans, _ = world2
    for name in MODELS:
        attn = [
            d for d in plans[(name, "sp")].decisions if d.op == "aten.scaled_dot_product_attention.default"
        ]
        assert attn and all(d.inputs[0] == "S(2)" and d.inputs[1:3] == ("R", "R") for d in attn), attn
        if name == "bert":
            # an explicit [B, 1, S, S] mask (not the causal one): its query rows are sharded with q,
            # so the plain op runs on local rows
            assert all(d.inputs[3] == "S(2)" for d in attn)
        else:
            # the decoders' traced causal mask is rewritten to is_causal=True (passes/causal_mask.py): local
            # rows need the mask of global positions (codegen/local_ops.py), and the outputs and
            # trained weights checked above show it is right
            assert all(len(d.inputs) == 3 for d in attn), attn
            assert "causal_attention_rows" in code_of(world2, name, "sp")
