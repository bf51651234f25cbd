"""A tiny PaLM-style causal LM in plain torch.

PaLM's block (Chowdhery et al., 2022): pre-norm with ONE shared LayerNorm (no bias) feeding a
PARALLEL attention and MLP, ``y = x + attn(ln(x)) + mlp(ln(x))``; multi-query attention (``heads``
query heads, a single key/value head); SwiGLU MLP; rotary position embeddings on q and k; no
biases anywhere; input and output embeddings tied. ``forward(input_ids, labels=None)`` returns a
:class:`PalmOutput` (a NamedTuple: ``.loss``, ``.logits``, flattenable by torch.export's pytree).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models import next_token_loss


class PalmOutput(NamedTuple):
    loss: torch.Tensor | None
    logits: torch.Tensor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [seq, head_dim] (broadcast over batch and heads)."""
    return x * cos + rotate_half(x) * sin


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_seq: int, base: float = 10000.0):
        super().__init__()
        self.head_dim, self.max_seq, self.base = head_dim, max_seq, base
        self.register_buffer("cos", torch.empty(max_seq, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq, head_dim), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The tables, computed where the buffers are (again after a meta-device build:
        ``codegen/weights.py`` initializes a model's modules with ``reset_parameters``)."""
        device = self.cos.device
        inv_freq = 1.0 / (
            self.base
            ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim)
        )
        freqs = torch.outer(torch.arange(self.max_seq, dtype=torch.float32, device=device), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_seq, head_dim]
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq], self.sin[:seq]


class MultiQueryAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        assert hidden % heads == 0
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, self.head_dim, bias=False)  # a single key head
        self.v_proj = nn.Linear(hidden, self.head_dim, bias=False)  # a single value head
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)  # [b, H, s, d]
        k = self.k_proj(x).view(b, s, 1, self.head_dim).transpose(1, 2)  # [b, 1, s, d]
        v = self.v_proj(x).view(b, s, 1, self.head_dim).transpose(1, 2)  # [b, 1, s, d]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


class PalmBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, bias=False)  # one norm shared by attention and MLP
        self.attn = MultiQueryAttention(hidden, heads)
        self.mlp = SwiGLU(hidden, ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h, cos, sin) + self.mlp(h)  # parallel attention + MLP


class PalmLM(nn.Module):
    def __init__(
        self, vocab: int = 256, hidden: int = 64, layers: int = 2, heads: int = 4, max_seq: int = 64
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.rotary = Rotary(hidden // heads, max_seq)
        self.blocks = nn.ModuleList(PalmBlock(hidden, heads, 4 * hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> PalmOutput:
        x = self.embed(input_ids)
        cos, sin = self.rotary(input_ids.shape[1])
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = F.linear(self.norm(x), self.embed.weight)  # tied output embedding
        loss = None
        if labels is not None:
            loss = next_token_loss(logits, labels)
        return PalmOutput(loss, logits)
