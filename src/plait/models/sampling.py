"""The next token from logits: argmax, or sampling at a temperature from the top k and top p (generate and serving)."""

from __future__ import annotations

import torch


def filtered(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
             top_p: float = 1.0) -> torch.Tensor:
    """Logits at `temperature` with everything outside the top k and the top-p nucleus at -inf (temperature > 0)."""
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = probs.cumsum(-1) - probs  # the probability of the tokens ranked above each one
        drop = before >= top_p  # the top token is always kept (before = 0)
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return logits


def distribution(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float = 1.0) -> torch.Tensor:
    """The probabilities `sample` draws from (temperature > 0)."""
    return torch.softmax(filtered(logits, temperature, top_k, top_p), dim=-1)


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
           generator: torch.Generator | None = None, top_p: float = 1.0) -> torch.Tensor:
    """Token ids (..., 1) from logits (..., vocab): argmax when temperature <= 0, else sampling at temperature from
    the top k tokens and, within them, the smallest set whose probability reaches top_p (nucleus sampling)."""
    if temperature <= 0:
        return logits.float().argmax(-1, keepdim=True)
    return torch.multinomial(distribution(logits, temperature, top_k, top_p), 1, generator=generator)
