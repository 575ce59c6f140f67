"""Client-level DP: the RDP accountant against an independent numerical computation, monotone epsilon, the noise scale."""

import math

import numpy as np
import pytest
import torch
from scipy import integrate

from fed_helpers import update
from plait.federated.privacy import ORDERS, epsilon, rdp_sampled_gaussian
from plait.federated.strategies.dp import PrivacyPolicy
from plait.federated.tensors import flatten


def reference_rdp(q: float, sigma: float, alpha: int) -> float:
    """Renyi divergence D_alpha((1-q) N(0, s^2) + q N(1, s^2) || N(0, s^2)) by numerical integration (no binomials).

    The integrand exp(f(z)) is integrated as exp(f(z) - c) with c its maximum, so large orders do not overflow.
    """
    def f(z):
        log_ratio = np.logaddexp(math.log1p(-q), math.log(q) + (2 * z - 1) / (2 * sigma**2))
        return -z * z / (2 * sigma**2) - math.log(sigma * math.sqrt(2 * math.pi)) + alpha * log_ratio

    lo, hi = -20 * sigma, alpha + 20 * sigma  # the q-term's mass sits near z = alpha - 1/2
    c = float(f(np.linspace(lo, hi, 4001)).max())
    value, _ = integrate.quad(lambda z: math.exp(f(z) - c), lo, hi, points=[0.0, 0.5, alpha - 0.5], limit=1000,
                              epsabs=0, epsrel=1e-11)
    return (math.log(value) + c) / (alpha - 1)


@pytest.mark.parametrize("q, sigma", [(0.1, 1.1), (0.3, 2.0), (0.02, 0.8)])
def test_rdp_matches_numerical_integration(q, sigma):
    for alpha in (2, 3, 8, 20):
        assert rdp_sampled_gaussian(q, sigma, alpha) == pytest.approx(reference_rdp(q, sigma, alpha), rel=1e-6)


def test_full_participation_is_the_gaussian_mechanism():
    assert rdp_sampled_gaussian(1.0, 2.0, 10) == pytest.approx(10 / (2 * 4.0))


def test_epsilon_is_monotone_in_rounds_and_matches_the_reference_conversion():
    q, sigma, delta = 0.1, 1.1, 1e-5
    eps = [epsilon(q, sigma, t, delta)[0] for t in (1, 10, 30, 100, 300)]
    assert all(a < b for a, b in zip(eps, eps[1:]))
    # Independent: RDP from integration at every integer order up to 64, composed over 30 rounds, Mironov 2017 Prop. 3.
    orders = [a for a in ORDERS if a <= 64]
    ref = min(30 * reference_rdp(q, sigma, a) + math.log(1 / delta) / (a - 1) for a in orders)
    got, order = epsilon(q, sigma, 30, delta, tuple(orders))
    assert got == pytest.approx(ref, rel=1e-6)
    assert 2 < order < 64  # an interior optimum: the order grid is wide enough
    assert epsilon(q, sigma, 30, delta)[0] <= got + 1e-12  # more orders can only lower it
    assert epsilon(q, 2 * sigma, 30, delta)[0] < got / 2  # more noise, much less epsilon


def test_noise_has_the_calibrated_scale_and_the_update_is_clipped():
    policy = PrivacyPolicy(noise_multiplier=1.5, clip_norm=0.5, sample_rate=0.2, total_clients=50, delta=1e-5,
                           generator=torch.Generator().manual_seed(0))
    out = policy.noised_mean(torch.zeros(200_000, dtype=torch.float64))
    # std = z * S / (q * N) = 1.5 * 0.5 / 10
    assert float(out.std()) == pytest.approx(0.075, rel=0.01) and abs(float(out.mean())) < 1e-3
    big = update(0, 1, 10.0)
    assert float(flatten(policy.clip(big.delta)).norm()) == pytest.approx(0.5)
    agg = policy.aggregate([big, update(1, 1, 0.0)], big.delta)
    assert agg.num_samples == 1 and policy.rounds == 2
    assert policy.epsilon() == pytest.approx(epsilon(0.2, 1.5, 2, 1e-5)[0])


def test_simulated_run_reports_epsilon_per_round():
    from fed_helpers import fed_config
    from plait.federated.simulate import simulate

    cfg = fed_config("federated.rounds=3", "federated.clients=5", "federated.clients_per_round=0.6",
                     "federated.dp_noise_multiplier=1.0", "federated.dp_clip_norm=0.5", "federated.local_epochs=1",
                     "federated.min_clients=1")
    summary = simulate(cfg, None, log=None)
    assert summary["rounds"] == 3 and summary["epsilon"] == pytest.approx(epsilon(0.6, 1.0, 3, 1e-5)[0])
    assert np.isfinite(summary["test_loss"])
