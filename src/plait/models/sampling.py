"""The next token from logits: argmax, or sampling at a temperature from the top k (GPT.generate and serving)."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Token ids (..., 1) from logits (..., vocab): argmax when temperature <= 0, else top-k sampling at temperature."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
