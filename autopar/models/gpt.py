"""A GPT-3 decoder in plain torch, laid out as Megatron-LM's ``GPTModel`` runs it.

Pre-norm LayerNorm (with bias), learned position embeddings, multi-head attention with queries,
keys and values projected per head (Megatron's fused QKV weight is laid out head by head, so a
tensor axis splitting heads needs no reshuffle), a 4h MLP with one-op exact GELU (Megatron fuses
bias and GELU), biases on every linear, a final LayerNorm and the output projection tied to the
token embedding. Activations stay ``[batch, seq, hidden]`` from the embedding to the loss, as in
Megatron: Hugging Face's OPT, which the same weights also describe, flattens batch and sequence to
``[batch * seq, hidden]`` around its MLP, and a reshape that merges a batch split with a sequence
split has no placement in autopar's vocabulary (``passes/rules/shape.py:view_rule`` maps a merged
group's leading dim only), so on OPT sequence parallelism stops at the MLP and the residual stream
is split on the hidden dim instead, which Megatron never runs.

``attention``: "sdpa" (fused, as FlashAttention runs it) or "eager" (the scores materialized:
matmul, mask, softmax, matmul, as Megatron-LM ran attention before FlashAttention, 2022).
``forward(input_ids, labels=None)`` returns a :class:`GPTOutput` (``.loss``, ``.logits``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models import next_token_loss

ATTENTIONS = ("sdpa", "eager")


class GPTOutput(NamedTuple):
    loss: torch.Tensor | None
    logits: torch.Tensor


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, attention: str):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden {hidden} must divide by heads {heads}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention {attention!r}: one of {', '.join(ATTENTIONS)}")
        self.heads, self.head_dim, self.attention = heads, hidden // heads, attention
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, self.head_dim).transpose(1, 2)  # [b, H, s, d]

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            y = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.out_proj(y.transpose(1, 2).reshape(b, s, h))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, attention: str):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attn = Attention(hidden, heads, attention)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.fc2(F.gelu(self.fc1(self.post_attention_layernorm(x))))


class GPT(nn.Module):
    def __init__(
        self,
        vocab: int = 256,
        hidden: int = 64,
        layers: int = 2,
        heads: int = 4,
        max_seq: int = 64,
        attention: str = "sdpa",
    ):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.embed_positions = nn.Embedding(max_seq, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, attention) for _ in range(layers))
        self.final_layernorm = nn.LayerNorm(hidden)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        nn.init.normal_(self.embed_positions.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> GPTOutput:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for block in self.layers:
            x = block(x)
        logits = F.linear(self.final_layernorm(x), self.embed_tokens.weight)  # tied output embedding
        loss = None
        if labels is not None:
            loss = next_token_loss(logits, labels)
        return GPTOutput(loss, logits)
