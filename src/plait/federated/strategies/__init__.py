"""Federated strategies, one per file, behind the `configure_round` / `aggregate` pair of `Strategy`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.federated.strategies.base import ClientUpdate, Combine, RoundPlan, Strategy, sample_count, select_clients
from plait.federated.strategies.fedadam import FedAdam
from plait.federated.strategies.fedavg import FedAvg
from plait.federated.strategies.fedprox import FedProx
from plait.federated.strategies.fedsgd import FedSGD

if TYPE_CHECKING:
    from plait.config import FederatedConfig

STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (FedAvg, FedProx, FedAdam, FedSGD)}


def build_strategy(fed: FederatedConfig, combine: Combine | None = None) -> Strategy:
    """The strategy named by federated.strategy, combining updates with `combine` (default: the configured aggregator)."""
    from plait.federated.robust import make_combine

    return STRATEGIES[fed.strategy](fed, combine or make_combine(fed.aggregator, fed.trim_fraction))


__all__ = ["STRATEGIES", "ClientUpdate", "Combine", "FedAdam", "FedAvg", "FedProx", "FedSGD", "RoundPlan", "Strategy",
           "build_strategy", "sample_count", "select_clients"]
