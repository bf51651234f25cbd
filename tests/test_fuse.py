"""The fuse pass finds the kernels' patterns in the aten graphs of many families and the rewritten
graph computes what the traced one does.

For Llama, Mistral, Qwen2, Gemma (``1 + weight`` RMSNorm, GeGLU), GPT-NeoX (partial rotary,
residual + LayerNorm), GPT-2 and the PaLM-style model (rotary through ``chunk``), each traced on
tiny configs with ``Outputs.LOSS``: the number of substitutions of each kernel is what the
architecture implies per layer (so a pattern missed in one family, or matched where it should
not be, fails), and the fused graph's loss and every parameter's gradient equal the traced
graph's (the torch fallbacks run here; the Triton paths are tested against the same fallbacks
in ``tests/test_kernels.py``). A plan re-applied to the same model rewrites the same nodes, and
one applied to another graph is refused.
"""

from __future__ import annotations

import copy

import pytest
import torch

from autopar.errors import PlanMismatchError
from autopar.examples import gpt2_tiny, llama_tiny, palm_tiny
from autopar.fusion import Kernel, KernelUse
from autopar.hardware import DeviceKind
from autopar.passes.fuse import chosen_kernels, fuse, fuse_as_planned
from autopar.passes.trace import keep_loss_only, trace
from autopar.tools.validate import placeholder_values

LAYERS, HIDDEN, VOCAB = 2, 32, 96
K = Kernel


def _hf(config_cls, model_cls, **extra):
    import transformers as tf

    def build():
        torch.manual_seed(0)
        cfg = getattr(tf, config_cls)(
            num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=4,
            vocab_size=VOCAB, max_position_embeddings=64, use_cache=False, bos_token_id=0, eos_token_id=0,
            pad_token_id=0, **extra,
        )  # fmt: skip
        ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
        return getattr(tf, model_cls)(cfg), {"input_ids": ids, "labels": ids}

    return build


L = LAYERS
# family -> (builder, kernel -> substitutions)
FAMILIES = {
    "llama": (
        lambda: llama_tiny(batch=2, seq=8, layers=L, hidden=HIDDEN, vocab=VOCAB),
        {K.RMS_NORM: 2 * L + 1, K.SWIGLU: L, K.ROPE: 2 * L, K.LINEAR_CROSS_ENTROPY: 1},
    ),
    "mistral": (
        _hf("MistralConfig", "MistralForCausalLM", num_key_value_heads=2, sliding_window=None),
        {K.RMS_NORM: 2 * L + 1, K.SWIGLU: L, K.ROPE: 2 * L, K.LINEAR_CROSS_ENTROPY: 1},
    ),
    "qwen2": (
        _hf("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2),
        {K.RMS_NORM: 2 * L + 1, K.SWIGLU: L, K.ROPE: 2 * L, K.LINEAR_CROSS_ENTROPY: 1},
    ),
    "gemma": (
        _hf("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=2, head_dim=8),
        {K.RMS_NORM: 2 * L + 1, K.GEGLU: L, K.ROPE: 2 * L, K.LINEAR_CROSS_ENTROPY: 1},
    ),
    "gpt_neox": (
        _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", rotary_pct=0.5, use_parallel_residual=False),
        # 2L + 1 norms, the first reads the embedding alone (nothing to add); partial rotary
        {K.LAYER_NORM: 2 * L, K.ROPE: 2 * L, K.LINEAR_CROSS_ENTROPY: 1},
    ),
    "gpt2": (
        lambda: gpt2_tiny(batch=2, seq=8, layers=L, hidden=HIDDEN, vocab=VOCAB),
        {K.LAYER_NORM: 2 * L, K.LINEAR_CROSS_ENTROPY: 1},
    ),
    "palm": (
        lambda: palm_tiny(batch=2, seq=8, layers=L, hidden=HIDDEN, vocab=VOCAB),
        {K.LAYER_NORM: L, K.SWIGLU: L, K.ROPE: 2 * L, K.LINEAR_CROSS_ENTROPY: 1},
    ),
}


def _traced(build):
    model, inputs = build()
    tg = trace(model, inputs)
    keep_loss_only(tg)
    return tg, inputs


def _loss_and_grads(tg, inputs):
    values = placeholder_values(tg, inputs, seed=0)
    params = {p.name for p in tg.placeholders if p.role.value == "param"}
    names = [n.name for n in tg.graph.nodes if n.op == "placeholder"]
    leaves = [
        v.detach().clone().requires_grad_(n in params and v.is_floating_point())
        for n, v in zip(names, values)
    ]
    loss = tg.graph_module(*leaves)[0]
    loss.backward()
    return loss.detach(), {n: v.grad for n, v in zip(names, leaves) if v.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_fuses_its_patterns_and_computes_the_same(family):
    build, expected = FAMILIES[family]
    tg, inputs = _traced(build)
    want = _loss_and_grads(tg, inputs)
    fused = copy.deepcopy(tg)
    uses = fuse(fused, set(Kernel))
    counts = {}
    for u in uses:
        counts[u.kernel] = counts.get(u.kernel, 0) + 1
    assert counts == expected, f"{family}: {counts}"
    fused.graph.lint()
    targets = {str(n.target) for n in fused.graph.nodes if n.op == "call_function"}
    assert "aten.cross_entropy_loss.default" not in targets and "aten.rsqrt.default" not in targets
    got = _loss_and_grads(fused, inputs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert set(got[1]) == set(want[1])
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-4, atol=1e-6, msg=f"{family}: gradient of {name}")


def test_kernels_chosen_by_device_unless_forced():
    assert chosen_kernels(DeviceKind.CUDA, None) == frozenset(Kernel)
    assert chosen_kernels(DeviceKind.CPU, None) == frozenset()
    assert chosen_kernels(DeviceKind.CPU, frozenset({Kernel.ROPE})) == {Kernel.ROPE}


def test_a_plan_rewrites_the_same_nodes_again_and_refuses_another_graph():
    build = FAMILIES["llama"][0]
    tg, _ = _traced(build)
    uses = fuse(tg, set(Kernel))
    again, _ = _traced(build)
    fuse_as_planned(again, uses)
    assert again.kernels == uses and again.fingerprint() == tg.fingerprint()
    other, _ = _traced(FAMILIES["gpt2"][0])
    with pytest.raises(PlanMismatchError, match="re-plan"):
        fuse_as_planned(other, uses)
    bogus = (KernelUse(Kernel.ROPE, "rope_default_99", ("x",)),)
    with pytest.raises(PlanMismatchError):
        fuse_as_planned(_traced(build)[0], bogus)
