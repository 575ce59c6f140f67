"""The privacy accountant of client-level DP: epsilon after T rounds of the sampled Gaussian mechanism.

The mechanism (strategies/dp.py, DP-FedAvg of McMahan, Ramage, Talwar, Zhang 2018) samples
each client independently with probability q (Poisson sampling), clips each client's update to
L2 norm S, sums the clipped updates and adds N(0, (z S)^2 I). Adding or removing one client's
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
sampling, which the DP strategy wrapper asks for.
"""

from __future__ import annotations

import math

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
