"""Norm bounds on client updates: a large but finite update cannot move the model further than an ordinary one.

`NormBounded` wraps a strategy's Combine (the aggregator, see combine.py): before the aggregator
sees the round's updates it scales down those whose L2 norm is above an absolute bound
(federated.clip_norm) or far above the round's median norm (federated.norm_bound times it).
Malformed updates never get this far: the server rejects them on arrival (plait.federated.validate).
Under secure aggregation the server sees only a sum, so clients clip their own updates instead.
"""

from __future__ import annotations

import torch

from plait.federated.strategies.base import ClientUpdate, Combine
from plait.federated.tensors import Weights, clip, norm


def bound_norms(updates: list[ClientUpdate], clip_norm: float = 0.0,
                norm_bound: float = 0.0) -> tuple[list[ClientUpdate], list[int]]:
    """Apply the absolute clip, then the bound relative to the median norm (needs >= 3 updates to mean anything)."""
    clipped: set[int] = set()
    out = list(updates)
    if clip_norm > 0:
        for i, u in enumerate(out):
            delta, hit = clip(u.delta, clip_norm)
            if hit:
                out[i] = ClientUpdate(u.client_id, u.num_samples, delta, u.loss)
                clipped.add(u.client_id)
    if norm_bound > 0 and len(out) >= 3:
        limit = norm_bound * float(torch.tensor([norm(u.delta) for u in out]).median())
        if limit > 0:
            for i, u in enumerate(out):
                delta, hit = clip(u.delta, limit)
                if hit:
                    out[i] = ClientUpdate(u.client_id, u.num_samples, delta, u.loss)
                    clipped.add(u.client_id)
    return out, sorted(clipped)


class NormBounded:
    """A Combine: the round's updates within the norm bounds, then `combine` on them; `clipped` names whom it scaled."""

    def __init__(self, combine: Combine, clip_norm: float = 0.0, norm_bound: float = 0.0):
        self.combine, self.clip_norm, self.norm_bound = combine, clip_norm, norm_bound
        self.clipped: list[int] = []

    def bound(self, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """The updates scaled down to the bounds where they exceed them."""
        updates, self.clipped = bound_norms(updates, self.clip_norm, self.norm_bound)
        return updates

    def __call__(self, updates: list[ClientUpdate]) -> Weights:
        return self.combine(self.bound(updates))
