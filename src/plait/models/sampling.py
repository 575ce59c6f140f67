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


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id (..., 1) from each row of probabilities (..., vocab) (unnormalised is fine), by the inverse of
    the cumulative distribution at one uniform draw per row: exact (float64 sums; the first index whose cumulative
    sum exceeds the draw, so a token of probability 0 is never drawn) and about 15x cheaper than torch.multinomial
    on a CPU row of 32,000 tokens (76 against 1,228 us), which draws far more random numbers than one per row."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand(*probs.shape[:-1], 1, generator=generator, device=probs.device, dtype=torch.float64)
    return torch.searchsorted(cdf, u * cdf[..., -1:], right=True).clamp_(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
           generator: torch.Generator | None = None, top_p: float = 1.0) -> torch.Tensor:
    """Token ids (..., 1) from logits (..., vocab): argmax when temperature <= 0, else sampling at temperature from
    the top k tokens and, within them, the smallest set whose probability reaches top_p (nucleus sampling)."""
    if temperature <= 0:
        return logits.float().argmax(-1, keepdim=True)
    probs = distribution(logits, temperature, top_k, top_p)
    if not torch.isfinite(probs).all() or probs.sum() <= 0:
        raise ValueError("the sampling distribution is not a distribution (no token has a finite, positive probability)")
    return draw(probs, generator)
