"""Small plain-torch models used by ``autopar.examples`` (no Hugging Face dependency)."""

import torch
import torch.nn.functional as F


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A causal LM's loss: the logits at position ``t`` predict the label at ``t + 1`` (the labels
    shifted left, the last position ignored), mean cross-entropy over the tokens."""
    shifted = F.pad(labels.to(logits.device), (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), shifted.reshape(-1))
