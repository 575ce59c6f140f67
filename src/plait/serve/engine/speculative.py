"""Speculative decoding's acceptance rule (Leviathan et al. 2023; Chen et al. 2023): the output is the target's.

A small draft model proposes k tokens d_1..d_k, drawn from its distributions q_1..q_k; the target scores the
last real token and the k drafts in one forward, giving p_1..p_{k+1}. In order, d_i is accepted with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is drawn instead from the residual
norm(max(0, p_i - q_i)) and the rest is dropped; if all k are accepted, one more token comes from p_{k+1}. Each
emitted token is then distributed exactly as the target's own sampling would draw it:

    P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y q(y) min(1, p(y)/q(y))) norm(max(0, p - q))(x) = p(x)

Greedy (temperature 0) is the special case where p and q put all their mass on their argmax: a draft is kept
while it is the target's argmax, and the tokens are the target's greedy tokens. The distributions are the
processed ones (temperature, top-k, top-p: plait.models.sampling.distribution), the same for both models.
"""

from __future__ import annotations

import torch

from plait.models.sampling import distribution, draw, sample


def accept_probability(p: torch.Tensor, q: torch.Tensor, token: int) -> float:
    return min(1.0, float(p[token]) / float(q[token])) if float(q[token]) > 0 else 1.0


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); p itself where q covers p everywhere (then no draft is ever rejected)."""
    r = (p - q).clamp(min=0)
    total = r.sum()
    return r / total if float(total) > 0 else p


def verify(target_logits: torch.Tensor, drafts: list[int], draft_probs: list[torch.Tensor | None],
           temperature: float, top_k: int | None, top_p: float, generator: torch.Generator) -> list[int]:
    """The tokens to emit: the accepted drafts, then one drawn by the rule (a correction, or the bonus token).

    target_logits (len(drafts) + 1, vocab): the target's logits after the last real token and after each draft.
    draft_probs[i]: the distribution d_i was drawn from (None when greedy)."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        if temperature <= 0:
            best = int(target_logits[i].float().argmax())
            out.append(best)
            if best != d:
                return out
            continue
        q = draft_probs[i]
        assert q is not None, "a sampled draft needs the distribution it was drawn from"
        p = distribution(target_logits[i], temperature, top_k, top_p)
        if float(torch.rand(1, generator=generator)) < accept_probability(p, q, d):
            out.append(d)
            continue
        out.append(int(draw(residual(p, q), generator)))
        return out
    out.append(int(sample(target_logits[len(drafts)], temperature, top_k, generator, top_p)))
    return out
