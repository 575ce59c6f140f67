"""The rules that make one delta of a round's updates (a strategy's Combine), chosen by federated.aggregator.

- `weighted_mean`: FedAvg's n_k-weighted mean (McMahan et al. 2017);
- `median`: coordinate-wise median (Yin, Chen, Ramchandran, Bartlett 2018, "Byzantine-Robust
  Distributed Learning: Towards Optimal Statistical Rates");
- `trimmed_mean`: per coordinate, drop the largest and smallest `trim` share and average the
  rest (same paper). Both robust aggregators ignore sample counts, so a client cannot buy
  influence by inflating its count.
"""

from __future__ import annotations

import math

import torch

from plait.federated.strategies.base import ClientUpdate, Combine
from plait.federated.tensors import Weights, flatten, unflatten


def _stack(updates: list[ClientUpdate]) -> torch.Tensor:
    return torch.stack([flatten(u.delta) for u in updates])


def weighted_mean(updates: list[ClientUpdate]) -> Weights:
    """sum_k n_k delta_k / sum_k n_k (in float64)."""
    w = torch.tensor([float(u.num_samples) for u in updates], dtype=torch.float64)
    vec = (w[:, None] * _stack(updates)).sum(0) / w.sum()
    return unflatten(vec, updates[0].delta)


def coordinate_median(x: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise median of the rows of x (for an even count, the mean of the two middle values)."""
    x = x.sort(dim=0).values
    n = x.shape[0]
    return x[n // 2] if n % 2 else (x[n // 2 - 1] + x[n // 2]) / 2


def median(updates: list[ClientUpdate]) -> Weights:
    """Coordinate-wise median (for an even count, the mean of the two middle values)."""
    return unflatten(coordinate_median(_stack(updates)), updates[0].delta)


def trimmed_mean(updates: list[ClientUpdate], trim: float) -> Weights:
    """Per coordinate, drop floor(trim * n) largest and smallest values, average the rest."""
    x = _stack(updates)
    k = int(math.floor(trim * len(updates)))
    if k and len(updates) - 2 * k >= 1:
        x = x.sort(dim=0).values[k:len(updates) - k]
    return unflatten(x.mean(0), updates[0].delta)


def make_combine(name: str, trim: float = 0.1) -> Combine:
    """The aggregator named by federated.aggregator."""
    if name == "mean":
        return weighted_mean
    if name == "median":
        return median
    if name == "trimmed_mean":
        return lambda updates: trimmed_mean(updates, trim)
    raise ValueError(f"unknown aggregator {name!r}; choose mean, median or trimmed_mean")
