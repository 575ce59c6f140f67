"""Shared helpers of the federated tests: tiny weights, updates and a coordinator without a model."""

from __future__ import annotations

import math

import torch

from plait.config import load_config
from plait.federated.server import Coordinator
from plait.federated.strategies import ClientUpdate, build_strategy

FAST_FED = ["model.name='mlp'", "data.name='digits'", "log.report=false", "federated.local_lr=0.1"]


def fed_config(*overrides: str):
    return load_config(None, FAST_FED + list(overrides))


def template() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(2, 3), "b": torch.zeros(3)}


def update(client_id: int, n: int, value: float | torch.Tensor, loss: float = math.nan) -> ClientUpdate:
    t = template()
    if isinstance(value, torch.Tensor):
        return ClientUpdate(client_id, n, {"w": value[:6].reshape(2, 3).float(), "b": value[6:].float()}, loss)
    return ClientUpdate(client_id, n, {k: torch.full_like(v, value) for k, v in t.items()}, loss)


def coordinator(*overrides: str, weights: dict | None = None) -> Coordinator:
    """A Coordinator over `template()` weights whose evaluation returns (norm of weights, 0)."""
    cfg = fed_config(*overrides)
    w = weights if weights is not None else template()
    evaluate = lambda ws: (float(sum(v.double().norm() ** 2 for v in ws.values()) ** 0.5), 0.0)
    return Coordinator(cfg.federated, w, build_strategy(cfg.federated), evaluate, seed=0)
