"""FedSGD: the baseline of McMahan et al. 2017 — each client computes one full-batch gradient, the server takes one step.

With the n_k-weighted average of the clients' gradients this is large-batch SGD on the union of
the data, one step per round (FedAvg with E = 1 and B = infinity). Clients return
delta = -lr * g_k so the server's aggregation is the same weighted mean as FedAvg's.
"""

from __future__ import annotations

from plait.federated.strategies.base import Strategy


class FedSGD(Strategy):
    name = "fedsgd"

    def instructions(self, rnd: int) -> dict:
        return {**super().instructions(rnd), "mode": "gradient", "epochs": 1}
