"""Defences against malformed and hostile updates: validation, norm bounds, robust aggregators.

The server runs every received update through `check_update` (names, shapes, dtypes, finite
values, a plausible sample count) and drops the bad ones with a reason, then `bound_norms`
scales down updates whose L2 norm is above an absolute bound (`clip_norm`) or far above the
round's median norm (`norm_bound` times it): a large but finite update cannot move the model
further than an ordinary one. The aggregators then combine what is left:

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

MAX_SAMPLES = 10**9  # a reported sample count above this is not believed


def check_update(update: ClientUpdate, template: Weights) -> str | None:
    """Why this update cannot be used (a short reason), or None when it is well formed."""
    n = update.num_samples
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
        return f"num_samples {n!r} is not an integer in 1..{MAX_SAMPLES}"
    if not isinstance(update.delta, dict):
        return "the update is not a mapping of tensor names to tensors"
    names, want = set(update.delta), set(template)
    if names != want:  # order is free: safetensors stores names sorted
        missing, extra = sorted(want - names), sorted(map(str, names - want))
        return f"tensor names differ from the model's (missing {missing[:3]}, unexpected {extra[:3]})"
    for k, t in template.items():
        d = update.delta[k]
        if not isinstance(d, torch.Tensor):
            return f"{k} is a {type(d).__name__}, not a tensor"
        if tuple(d.shape) != tuple(t.shape):
            return f"{k} has shape {tuple(d.shape)}, the model's is {tuple(t.shape)}"
        if not d.is_floating_point():
            return f"{k} has dtype {d.dtype}, expected a floating-point tensor"
        if not bool(torch.isfinite(d).all()):
            return f"{k} holds NaN or Inf"
    return None


def clip(delta: Weights, max_norm: float) -> tuple[Weights, bool]:
    """Scale the update down to L2 norm max_norm when it is larger; returns it and whether it was clipped."""
    n = float(flatten(delta).norm())
    if not math.isfinite(n) or n <= max_norm:
        return delta, False
    s = max_norm / n
    return {k: v * s for k, v in delta.items()}, True


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
        norms = torch.tensor([float(flatten(u.delta).norm()) for u in out])
        limit = norm_bound * float(norms.median())
        if limit > 0:
            for i, u in enumerate(out):
                delta, hit = clip(u.delta, limit)
                if hit:
                    out[i] = ClientUpdate(u.client_id, u.num_samples, delta, u.loss)
                    clipped.add(u.client_id)
    return out, sorted(clipped)


def _stack(updates: list[ClientUpdate]) -> torch.Tensor:
    return torch.stack([flatten(u.delta) for u in updates])


def weighted_mean(updates: list[ClientUpdate]) -> Weights:
    """sum_k n_k delta_k / sum_k n_k (in float64)."""
    w = torch.tensor([float(u.num_samples) for u in updates], dtype=torch.float64)
    vec = (w[:, None] * _stack(updates)).sum(0) / w.sum()
    return unflatten(vec, updates[0].delta)


def median(updates: list[ClientUpdate]) -> Weights:
    """Coordinate-wise median (for an even count, the mean of the two middle values)."""
    x = _stack(updates).sort(dim=0).values
    n = len(updates)
    vec = x[n // 2] if n % 2 else (x[n // 2 - 1] + x[n // 2]) / 2
    return unflatten(vec, updates[0].delta)


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
