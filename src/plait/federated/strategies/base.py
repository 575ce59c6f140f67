"""The strategy contract: `configure_round` says who trains and how, `aggregate` turns updates into new weights.

Both return plain data (a RoundPlan of lists and numbers, a name -> tensor dict), so a strategy
can be tested without a server, and the same strategy runs under `plait fed server` and
`plait fed simulate`. The pair mirrors Flower's configure_* / aggregate_* strategy methods.
`aggregate` is `step(combine(updates))`: the Combine (a weighted mean, or a robust aggregator
within norm bounds, see combine.py and robust.py) makes one delta of the updates, `step` is the
server's optimizer. Under secure aggregation the server holds only a sum, which
`aggregate_sum` steps with. A `StrategyWrapper` takes an inner strategy and changes part of it,
as Flower's wrappers do: central differential privacy (dp.py) is one. Validation of received
updates and the masking protocol of secure aggregation stay in the server.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from plait.federated.tensors import Weights, unflatten

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
    """Base strategy: uniform client sampling, plain local SGD and a plain server step; subclasses change one of them."""

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
        """w <- step(combine(deltas)); with no updates the weights stay as they are."""
        if not updates:
            return weights
        return self.step(rnd, weights, self.combine(updates))

    def aggregate_sum(self, rnd: int, weights: Weights, total: torch.Tensor, total_weight: float) -> Weights:
        """Step with a sum the server cannot take apart (secure aggregation): sum_k w_k delta_k as one vector, and sum_k w_k."""
        if not total_weight > 0:
            raise ValueError(f"secure aggregation gave a total weight of {total_weight}")
        return self.step(rnd, weights, unflatten(total / total_weight, weights))

    def step(self, rnd: int, weights: Weights, delta: Weights) -> Weights:
        """The server's optimizer on the round's delta: w + server_lr * delta (in float64)."""
        return {k: (w.double() + self.server_lr * delta[k].double()).to(w.dtype) for k, w in weights.items()}

    def bound(self, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """The updates within the combine's norm bounds (robust.NormBounded), for a wrapper that combines them itself."""
        bound = getattr(self.combine, "bound", None)
        return bound(updates) if bound is not None else updates

    def clipped(self) -> list[int]:
        """Clients whose update the last norm bounds scaled down."""
        return list(getattr(self.combine, "clipped", []))

    def epsilon(self) -> float | None:
        """The privacy spent so far, or None for a strategy that adds no noise."""
        return None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Server-side optimizer state (none for averaging strategies)."""
        return {}


class StrategyWrapper(Strategy):
    """A strategy around an inner one, in the manner of Flower's strategy wrappers: what it does not override is the inner's."""

    def __init__(self, inner: Strategy):
        self.inner = inner

    @property
    def name(self) -> str:
        return self.inner.name

    def configure_round(self, rnd: int, available: list[int], rng: np.random.Generator, poisson: bool = False) -> RoundPlan:
        return self.inner.configure_round(rnd, available, rng, poisson)

    def aggregate(self, rnd: int, weights: Weights, updates: list[ClientUpdate]) -> Weights:
        return self.inner.aggregate(rnd, weights, updates)

    def aggregate_sum(self, rnd: int, weights: Weights, total: torch.Tensor, total_weight: float) -> Weights:
        return self.inner.aggregate_sum(rnd, weights, total, total_weight)

    def step(self, rnd: int, weights: Weights, delta: Weights) -> Weights:
        return self.inner.step(rnd, weights, delta)

    def bound(self, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        return self.inner.bound(updates)

    def clipped(self) -> list[int]:
        return self.inner.clipped()

    def epsilon(self) -> float | None:
        return self.inner.epsilon()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.inner.state_dict()
