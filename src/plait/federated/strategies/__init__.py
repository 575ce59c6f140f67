"""Federated strategies, one per file, behind the `configure_round` / `aggregate` pair of `Strategy`.

`build_strategy` composes what the config asks for: the strategy (fedavg, fedprox, fedadam,
fedsgd) with its Combine (the aggregator within the norm bounds) and, when
federated.dp_noise_multiplier > 0, the central-DP wrapper around it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.federated.strategies.base import (
    ClientUpdate,
    Combine,
    RoundPlan,
    Strategy,
    StrategyWrapper,
    sample_count,
    select_clients,
)
from plait.federated.strategies.combine import make_combine
from plait.federated.strategies.dp import DPFixedClipping, PrivacyPolicy, sample_rate
from plait.federated.strategies.fedadam import FedAdam
from plait.federated.strategies.fedavg import FedAvg
from plait.federated.strategies.fedprox import FedProx
from plait.federated.strategies.fedsgd import FedSGD
from plait.federated.strategies.robust import NormBounded

if TYPE_CHECKING:
    import torch

    from plait.config import FederatedConfig

STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (FedAvg, FedProx, FedAdam, FedSGD)}


def build_strategy(fed: FederatedConfig, combine: Combine | None = None, generator: torch.Generator | None = None) -> Strategy:
    """federated.strategy, combining by `combine` (or federated.aggregator) in norm bounds, DP-wrapped (noise from `generator`)."""
    combine = combine or make_combine(fed.aggregator, fed.trim_fraction)
    if fed.clip_norm > 0 or fed.norm_bound > 0:
        combine = NormBounded(combine, fed.clip_norm, fed.norm_bound)
    strategy = STRATEGIES[fed.strategy](fed, combine)
    if fed.dp_noise_multiplier > 0:
        policy = PrivacyPolicy(fed.dp_noise_multiplier, fed.dp_clip_norm, sample_rate(fed), fed.clients, fed.dp_delta, generator)
        strategy = DPFixedClipping(strategy, policy)
    return strategy


__all__ = ["STRATEGIES", "ClientUpdate", "Combine", "DPFixedClipping", "FedAdam", "FedAvg", "FedProx", "FedSGD", "NormBounded",
           "PrivacyPolicy", "RoundPlan", "Strategy", "StrategyWrapper", "build_strategy", "sample_count", "select_clients"]
