"""The strategy contract: `configure_round` says who trains and how, `aggregate` turns updates into new weights.

Both return plain data (a RoundPlan of lists and numbers, a name -> tensor dict), so a strategy
can be tested without a server, and the same strategy runs under `plait fed server` and
`plait fed simulate`. The pair mirrors Flower's configure_* / aggregate_* strategy methods.
Robustness (validation, norm bounds), secure aggregation and differential privacy happen in the
server around the strategy; the strategy only decides how surviving updates move the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from plait.federated.tensors import Weights

if TYPE_CHECKING:
    from plait.config import FederatedConfig


@dataclass
class ClientUpdate:
    """One client's result: its weights minus the round's global weights, and how many samples it trained on."""

    client_id: int
    num_samples: int
    delta: Weights
    loss: float = math.nan


@dataclass
class RoundPlan:
    """Who trains in a round and the instructions each of them receives (plain JSON-able data)."""

    round: int
    clients: list[int]
    instructions: dict = field(default_factory=dict)


Combine = Callable[[list[ClientUpdate]], Weights]


def sample_count(per_round: float, total: int) -> int:
    """clients_per_round as a count: a fraction (<= 1) of `total`, or the count itself."""
    n = round(per_round * total) if per_round <= 1 else int(per_round)
    return max(1, min(total, n))


def select_clients(available: list[int], per_round: float, total: int, rng: np.random.Generator,
                   poisson: bool = False) -> list[int]:
    """Sample the round's clients among those available.

    With `poisson` each available client is taken independently with probability
    count / total: the sampling the differential-privacy accountant assumes.
    """
    available = sorted(available)
    if poisson:
        q = sample_count(per_round, total) / total
        return [c for c, u in zip(available, rng.random(len(available))) if u < q]
    k = min(len(available), sample_count(per_round, total))
    return sorted(int(c) for c in rng.choice(available, size=k, replace=False)) if k else []


class Strategy:
    """Base strategy: uniform client sampling and plain local SGD; subclasses change one of the pair."""

    name = "base"
    default_server_lr = 1.0

    def __init__(self, fed: FederatedConfig, combine: Combine):
        self.fed = fed
        self.combine = combine
        self.server_lr = fed.server_lr or self.default_server_lr

    def instructions(self, rnd: int) -> dict:
        f = self.fed
        return {"mode": "local", "epochs": f.local_epochs, "batch_size": f.local_batch_size, "lr": f.local_lr,
                "momentum": f.local_momentum, "mu": 0.0}

    def configure_round(self, rnd: int, available: list[int], rng: np.random.Generator, poisson: bool = False) -> RoundPlan:
        clients = select_clients(available, self.fed.clients_per_round, self.fed.clients, rng, poisson)
        return RoundPlan(rnd, clients, self.instructions(rnd))

    def aggregate(self, rnd: int, weights: Weights, updates: list[ClientUpdate]) -> Weights:
        """w <- w + server_lr * combine(deltas); with no updates the weights stay as they are."""
        if not updates:
            return weights
        step = self.combine(updates)
        return {k: (w.double() + self.server_lr * step[k].double()).to(w.dtype) for k, w in weights.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Server-side optimizer state (none for averaging strategies)."""
        return {}
