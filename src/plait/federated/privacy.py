"""Client-level differential privacy for federated rounds: clip, add Gaussian noise, account for epsilon.

Mechanism (DP-FedAvg, McMahan, Ramage, Talwar, Zhang 2018, "Learning Differentially Private
Recurrent Language Models", ICLR): each round samples every client independently with
probability q (Poisson sampling), clips each client's update to L2 norm S, sums the clipped
updates, adds N(0, (z S)^2 I) and divides by the *expected* number of clients q N (a fixed
denominator, so one client changes the sum by at most S). Adding or removing one client's
whole data therefore changes one round's output like the sampled Gaussian mechanism with
sampling rate q and noise multiplier z.

Accounting (the moments accountant of Abadi, Chu, Goodfellow, McMahan, Mironov, Talwar, Zhang
2016, "Deep Learning with Differential Privacy", in the Rényi-DP form of Mironov 2017,
"Rényi Differential Privacy"): for integer orders alpha >= 2 the sampled Gaussian mechanism has
RDP epsilon(alpha) = log(A_alpha) / (alpha - 1) with (Mironov, Talwar, Zhang 2019, "Rényi
Differential Privacy of the Sampled Gaussian Mechanism", Section 3.3)

    A_alpha = sum_{k=0}^{alpha} C(alpha, k) (1 - q)^(alpha - k) q^k exp((k^2 - k) / (2 z^2)).

RDP composes additively over T rounds, and (Mironov 2017, Proposition 3)

    epsilon(delta) = min_alpha  T * epsilon(alpha) + log(1 / delta) / (alpha - 1).

With q = 1 this is the Gaussian mechanism's alpha / (2 z^2). The accountant assumes Poisson
sampling, which the server uses whenever dp_noise_multiplier > 0.

Trust: this is central DP. The server adds the noise, so ε bounds what the released models
reveal to anyone else, not what the server sees; with secure aggregation the server sees only the
un-noised sum of clipped updates, without it each clipped update.
"""

from __future__ import annotations

import math
import secrets

import torch

from plait.federated.strategies.base import ClientUpdate
from plait.federated.tensors import Weights, flatten, unflatten

ORDERS: tuple[int, ...] = tuple(range(2, 65)) + (80, 96, 128, 192, 256, 384, 512, 1024)


def _logsumexp(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def rdp_sampled_gaussian(q: float, noise_multiplier: float, alpha: int) -> float:
    """RDP epsilon at integer order alpha of one round of the sampled Gaussian mechanism (formula above)."""
    if not (0 < q <= 1) or noise_multiplier <= 0 or alpha < 2 or int(alpha) != alpha:
        raise ValueError(f"need 0 < q <= 1, noise_multiplier > 0 and an integer order >= 2 (got {q}, {noise_multiplier}, {alpha})")
    z2 = noise_multiplier**2
    if q == 1.0:
        return alpha / (2 * z2)
    terms = [
        math.lgamma(alpha + 1) - math.lgamma(k + 1) - math.lgamma(alpha - k + 1)
        + (alpha - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * z2)
        for k in range(alpha + 1)
    ]
    return _logsumexp(terms) / (alpha - 1)


def epsilon(q: float, noise_multiplier: float, rounds: int, delta: float,
            orders: tuple[int, ...] = ORDERS) -> tuple[float, int]:
    """(epsilon, best order) after `rounds` rounds at sampling rate q, for the given delta."""
    if rounds <= 0:
        return 0.0, orders[0]
    best = min((rounds * rdp_sampled_gaussian(q, noise_multiplier, a) + math.log(1 / delta) / (a - 1), a) for a in orders)
    return best


class PrivacyPolicy:
    """The server's DP step: clip, sum, noise, divide by the expected client count; and the running epsilon."""

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
        n = float(flatten(delta).norm())
        return delta if n <= self.clip_norm else {k: v * (self.clip_norm / n) for k, v in delta.items()}

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
        return epsilon(self.q, self.z, self.rounds, self.delta)[0]
