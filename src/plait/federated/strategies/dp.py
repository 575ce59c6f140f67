"""Central client-level differential privacy as a strategy wrapper (Flower: DifferentialPrivacyServerSideFixedClipping).

Mechanism (DP-FedAvg, McMahan, Ramage, Talwar, Zhang 2018, "Learning Differentially Private
Recurrent Language Models", ICLR): each round samples every client independently with
probability q (Poisson sampling), clips each client's update to L2 norm S, sums the clipped
updates, adds N(0, (z S)^2 I) and divides by the *expected* number of clients q N (a fixed
denominator, so one client changes the sum by at most S). The inner strategy then takes its
server step with that noised mean; its epsilon comes from the accountant in plait.federated.privacy.

Trust: this is central DP. The server adds the noise, so ε bounds what the released models
reveal to anyone else, not what the server sees; with secure aggregation the server sees only the
un-noised sum of clipped updates, without it each clipped update.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

import numpy as np
import torch

from plait.federated.privacy import epsilon
from plait.federated.strategies.base import ClientUpdate, RoundPlan, Strategy, StrategyWrapper, sample_count
from plait.federated.tensors import Weights, clip, flatten, unflatten

if TYPE_CHECKING:
    from plait.config import FederatedConfig


def sample_rate(fed: FederatedConfig) -> float:
    """The per-round sampling probability the DP accountant uses: clients per round / clients."""
    return sample_count(fed.clients_per_round, fed.clients) / fed.clients


class PrivacyPolicy:
    """The DP step: clip, sum, noise, divide by the expected client count; and the running epsilon."""

    def __init__(self, noise_multiplier: float, clip_norm: float, sample_rate: float, total_clients: int, delta: float,
                 generator: torch.Generator | None = None):
        self.z, self.clip_norm, self.q = noise_multiplier, clip_norm, sample_rate
        self.total_clients, self.delta = total_clients, delta
        self.rounds = 0
        self.generator = generator or torch.Generator().manual_seed(secrets.randbits(63))

    @property
    def expected_clients(self) -> float:
        return self.q * self.total_clients

    def clip(self, delta: Weights) -> Weights:
        """The update scaled down to L2 norm S if it is larger."""
        return clip(delta, self.clip_norm)[0]

    def noised_mean(self, clipped_sum: torch.Tensor) -> torch.Tensor:
        """(sum of clipped updates + N(0, (z S)^2)) / (q N); counts one round against the budget."""
        noise = torch.randn(clipped_sum.shape, generator=self.generator, dtype=torch.float64) * (self.z * self.clip_norm)
        self.rounds += 1
        return (clipped_sum.double() + noise) / self.expected_clients

    def aggregate(self, updates: list[ClientUpdate], template: Weights) -> ClientUpdate:
        """One update standing for the round: the noised mean of the clipped deltas (weights all 1)."""
        total = torch.zeros(sum(v.numel() for v in template.values()), dtype=torch.float64)
        for u in updates:
            total += flatten(self.clip(u.delta))
        return ClientUpdate(-1, 1, unflatten(self.noised_mean(total), template))

    def epsilon(self) -> float:
        """Epsilon at the policy's delta after the rounds noised so far."""
        return epsilon(self.q, self.z, self.rounds, self.delta)[0]


class DPFixedClipping(StrategyWrapper):
    """Central DP around a strategy: Poisson sampling, updates clipped to S, Gaussian noise on their sum, then the inner's step."""

    def __init__(self, inner: Strategy, policy: PrivacyPolicy):
        super().__init__(inner)
        self.policy = policy

    def configure_round(self, rnd: int, available: list[int], rng: np.random.Generator, poisson: bool = False) -> RoundPlan:
        """The inner plan, Poisson-sampled (what the accountant assumes), with clients told to clip to S and not weight."""
        plan = self.inner.configure_round(rnd, available, rng, poisson=True)
        # Clients clip too: under secure aggregation the server cannot, and only a sum of bounded updates is private.
        return RoundPlan(plan.round, plan.clients, {**plan.instructions, "clip_norm": self.policy.clip_norm, "unweighted": True})

    def aggregate(self, rnd: int, weights: Weights, updates: list[ClientUpdate]) -> Weights:
        """The inner step with the noised mean of the updates, each clipped to S after the inner's own norm bounds."""
        # The accountant covers this noised, unweighted sum only, so it takes the place of the inner's aggregator.
        noised = self.policy.aggregate(self.inner.bound(updates), weights)
        return self.inner.step(rnd, weights, noised.delta)

    def aggregate_sum(self, rnd: int, weights: Weights, total: torch.Tensor, total_weight: float) -> Weights:
        """Secure aggregation's sum of client-clipped, unweighted updates: noise it, divide by q N, step."""
        return self.inner.step(rnd, weights, unflatten(self.policy.noised_mean(total), weights))

    def epsilon(self) -> float:
        return self.policy.epsilon()
