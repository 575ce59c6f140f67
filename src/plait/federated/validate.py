"""Validation of received updates: malformed and hostile uploads are dropped, with a reason, before aggregation.

The server runs every received update through `check_update` (names, shapes, dtypes, finite
values, a plausible sample count) and rejects the bad ones. What is left is aggregated by the
strategy: within norm bounds (strategies/robust.py) and by the configured aggregator, which may
be a robust one, the coordinate-wise median or the trimmed mean (strategies/combine.py).
"""

from __future__ import annotations

import torch

from plait.federated.strategies.base import ClientUpdate
from plait.federated.tensors import Weights

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
