"""Small example models for the demo and for ``MODEL_SPEC``s such as ``autopar.examples:gpt2_tiny``.

Each function returns ``(model, example_inputs)``. Hugging Face models are built from configs
(no weights are downloaded) with dropout off so that parallel runs can be compared exactly.
"""

from __future__ import annotations

import torch

from autopar.errors import ModelSpecError


def _transformers():
    try:
        import transformers
    except ImportError as e:  # transformers is a dev extra
        raise ModelSpecError(
            "this example needs Hugging Face transformers: pip install 'transformers>=5,<6' (or make setup)"
        ) from e
    return transformers


def _tokens(batch: int, seq: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def gpt2_tiny(batch: int = 8, seq: int = 32, layers: int = 2, hidden: int = 64, vocab: int = 256):
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=4, vocab_size=vocab, n_positions=max(seq, 64),
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    ids = _tokens(batch, seq, vocab)
    return tf.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


def llama_tiny(batch: int = 8, seq: int = 32, layers: int = 2, hidden: int = 64, vocab: int = 256):
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=max(seq, 64), use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    ids = _tokens(batch, seq, vocab)
    return tf.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}


def llama(
    layers: int = 32, hidden: int = 4096, ffn: int = 14336, heads: int = 32, kv_heads: int = 8,
    vocab: int = 128256, batch: int = 8, seq: int = 4096, dtype: str = "bfloat16",
):  # fmt: skip
    """A Llama of any shape (defaults: LLaMA-3-8B); build it under ``--meta`` to plan large ones,
    e.g. ``autopar.examples:llama(layers=80, hidden=8192, ffn=28672, heads=64)`` for a 70B shape."""
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=max(seq, 64), use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    ids = _tokens(batch, seq, vocab)
    return tf.LlamaForCausalLM(cfg).to(getattr(torch, dtype)), {"input_ids": ids, "labels": ids}


def gpt(
    layers: int = 96, hidden: int = 12288, heads: int = 96, vocab: int = 51200, batch: int = 8,
    seq: int = 2048, dtype: str = "bfloat16",
):  # fmt: skip
    """A GPT-3-style decoder of any shape (defaults: GPT 175B as Megatron-LM trains it: 4h MLP,
    learned positions, vocabulary padded to 51200); build it under ``--meta`` for large shapes."""
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=max(seq, 64),
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    ids = _tokens(batch, seq, vocab)
    return tf.GPT2LMHeadModel(cfg).to(getattr(torch, dtype)), {"input_ids": ids, "labels": ids}


def gpt3(
    layers: int = 96, hidden: int = 12288, heads: int = 96, vocab: int = 51200, batch: int = 8,
    seq: int = 2048, dtype: str = "bfloat16", attention: str = "sdpa",
):  # fmt: skip
    """A GPT-3 decoder as Megatron-LM's GPT runs it, for pricing Megatron's layouts (the plain-torch
    ``autopar.models.gpt``): pre-norm LayerNorm, learned positions, 4h MLP, biases, tied
    embeddings, as ``gpt``; but queries, keys and values projected per head (Megatron's fused QKV
    weight is laid out head by head, so splitting heads over a tensor axis needs no reshuffle, where
    GPT-2's ``c_attn`` is [q | k | v]), GELU as one op (Megatron fuses bias and GELU; GPT-2's
    ``gelu_new`` is seven elementwise ops) and activations kept ``[batch, seq, hidden]`` throughout
    (Hugging Face's OPT flattens them around its MLP, where sequence parallelism cannot follow).
    ``attention``: "sdpa" (fused, as FlashAttention runs it) or "eager" (the scores materialized:
    matmul, softmax, matmul, as Megatron-LM ran attention before FlashAttention, 2022)."""
    from autopar.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(
        vocab=vocab, hidden=hidden, layers=layers, heads=heads, max_seq=max(seq, 64), attention=attention
    )
    ids = _tokens(batch, seq, vocab)
    return model.to(getattr(torch, dtype)), {"input_ids": ids, "labels": ids}


def bert_tiny(batch: int = 8, seq: int = 32, layers: int = 2, hidden: int = 64, vocab: int = 256):
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.BertConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
        vocab_size=vocab, max_position_embeddings=max(seq, 64), hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip
    ids = _tokens(batch, seq, vocab)
    labels = ids.clone()
    labels[torch.rand(batch, seq, generator=torch.Generator().manual_seed(2)) > 0.15] = -100  # 15% masked
    return tf.BertForMaskedLM(cfg), {"input_ids": ids, "labels": labels}


def mlp(batch: int = 64, hidden: int = 256, ffn: int = 1024):
    """A plain-torch MLP block (no transformers needed): Linear -> GELU -> Linear, with an MSE loss."""

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(hidden, ffn)
            self.down = torch.nn.Linear(ffn, hidden)

        def forward(self, x, target):
            y = self.down(torch.nn.functional.gelu(self.up(x)))
            return torch.nn.functional.mse_loss(y, target), y

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return MLP(), (torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g))


def palm_tiny(
    batch: int = 4, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256
):
    """A plain-torch PaLM-style LM (``autopar.models.palm``): parallel attention + MLP, multi-query
    attention (one K/V head), SwiGLU, RoPE, no biases, tied embeddings. Returns ``.loss``/``.logits``."""
    from autopar.models.palm import PalmLM

    torch.manual_seed(0)
    model = PalmLM(vocab=vocab, hidden=hidden, layers=layers, heads=heads, max_seq=max(seq, 64))
    ids = _tokens(batch, seq, vocab)
    return model, {"input_ids": ids, "labels": ids}


def t5_tiny(
    batch: int = 4, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256
):
    """Hugging Face T5 (encoder-decoder, relative position buckets); the decoder inputs are the
    labels shifted right, built by the model itself."""
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.T5Config(
        vocab_size=vocab, d_model=hidden, d_kv=hidden // heads, d_ff=2 * hidden, num_layers=layers,
        num_decoder_layers=layers, num_heads=heads, relative_attention_num_buckets=8,
        relative_attention_max_distance=max(seq, 16), dropout_rate=0.0, use_cache=False,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    ids = _tokens(batch, seq, vocab)
    labels = _tokens(batch, seq, vocab, seed=2)
    return tf.T5ForConditionalGeneration(cfg), {"input_ids": ids, "labels": labels}


def vit_tiny(batch: int = 4, layers: int = 2, hidden: int = 64, heads: int = 4, num_labels: int = 10):
    """Hugging Face ViT image classifier on 32x32 images cut into 8x8 patches (a conv2d embedding)."""
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, intermediate_size=2 * hidden, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=num_labels,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(batch, 3, 32, 32, generator=g)
    labels = torch.randint(0, num_labels, (batch,), generator=g)
    return tf.ViTForImageClassification(cfg), {"pixel_values": pixels, "labels": labels}


MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def moe_tiny(
    family: str = "qwen3_moe",
    batch: int = 4,
    seq: int = 16,
    layers: int = 2,
    hidden: int = 32,
    experts: int = 4,
    top_k: int = 2,
    vocab: int = 64,
):
    """A tiny mixture-of-experts causal LM of one of ``MOE_FAMILIES`` (Hugging Face configs):
    ``experts`` routed experts of which each token takes ``top_k``; Qwen2-MoE and DeepSeek-V3 add a
    shared expert, DeepSeek-V3 its MLA attention, one dense first layer and grouped routing (one
    group)."""
    tf = _transformers()
    torch.manual_seed(0)
    common = dict(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
        max_position_embeddings=max(seq, 64), vocab_size=vocab, use_cache=False, attention_dropout=0.0,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, num_experts_per_tok=top_k,
    )  # fmt: skip
    if family == "mixtral":
        model = tf.MixtralForCausalLM(
            tf.MixtralConfig(num_key_value_heads=2, num_local_experts=experts, **common)
        )
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(
            num_key_value_heads=2, num_experts=experts, moe_intermediate_size=hidden,
            shared_expert_intermediate_size=hidden, **common,
        )  # fmt: skip
        model = tf.Qwen2MoeForCausalLM(cfg)
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            num_key_value_heads=2,
            num_experts=experts,
            moe_intermediate_size=hidden,
            decoder_sparse_step=1,
            **common,
        )
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif family == "deepseek_v3":
        cfg = tf.DeepseekV3Config(
            num_key_value_heads=4, n_routed_experts=experts, moe_intermediate_size=hidden, n_shared_experts=1,
            first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, n_group=1, topk_group=1, **common,
        )  # fmt: skip
        model = tf.DeepseekV3ForCausalLM(cfg)
    else:
        raise ModelSpecError(f"moe_tiny: unknown family {family!r}; known: {', '.join(MOE_FAMILIES)}")
    ids = _tokens(batch, seq, vocab)
    return model, {"input_ids": ids, "labels": ids}


def moe_plain_tiny(
    batch: int = 4, seq: int = 16, layers: int = 2, hidden: int = 32, experts: int = 4, top_k: int = 2
):
    """The plain-torch mixture-of-experts LM of ``autopar/models/moe.py`` (no Hugging Face)."""
    from autopar.models.moe import PlainMoE

    torch.manual_seed(0)
    vocab = 64
    ids = _tokens(batch, seq, vocab)
    model = PlainMoE(
        vocab=vocab, hidden=hidden, layers=layers, experts=experts, top_k=top_k, max_seq=max(seq, 64)
    )
    return model, {"input_ids": ids, "labels": ids}
