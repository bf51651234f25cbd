"""A tiny mixture-of-experts causal LM in plain torch, written unlike Hugging Face's.

Each block: pre-norm attention (``nn.MultiheadAttention``-free: plain SDPA, causal), then a
token-choice mixture of experts: a router (softmax over ``experts``, the top ``top_k`` taken and
renormalized to sum to one), experts stored as stacked ``[E, in, out]`` weights (not transposed),
SwiGLU with separate gate and up weights, each pair's expert weights gathered by its expert id and
applied by ``bmm``, and the weighted results added back to their tokens with ``index_add``.
``forward(input_ids, labels=None)`` returns a :class:`MoeOutput` (a NamedTuple: ``.loss``,
``.logits``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class MoeOutput(NamedTuple):
    loss: torch.Tensor | None
    logits: torch.Tensor


class Experts(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w_gate = nn.Parameter(torch.randn(experts, hidden, ffn) * hidden**-0.5)
        self.w_up = nn.Parameter(torch.randn(experts, hidden, ffn) * hidden**-0.5)
        self.w_down = nn.Parameter(torch.randn(experts, ffn, hidden) * ffn**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        probs = self.router(tokens).softmax(-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        expert, pair = torch.sort(ids.reshape(-1))
        token = pair // self.top_k
        rows = tokens[token].unsqueeze(1)
        gate = torch.bmm(rows, self.w_gate[expert])
        up = torch.bmm(rows, self.w_up[expert])
        y = torch.bmm(F.silu(gate) * up, self.w_down[expert]).squeeze(1)
        y = y * weights.reshape(-1)[pair].unsqueeze(-1)
        out = torch.zeros_like(tokens).index_add(0, token, y)
        return out.view(b, s, h)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, experts: int, top_k: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.moe = Experts(hidden, ffn, experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.moe(self.norm2(x))


class PlainMoE(nn.Module):
    def __init__(
        self, vocab: int = 64, hidden: int = 32, heads: int = 4, ffn: int = 32, layers: int = 2,
        experts: int = 4, top_k: int = 2, max_seq: int = 64,
    ):  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(max_seq, hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn, experts, top_k) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return MoeOutput(loss, logits)
