"""FedProx: FedAvg whose clients add a proximal term mu/2 * |w - w_global|^2 to their local loss.

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith 2020, "Federated Optimization in Heterogeneous
Networks" (MLSys). The term keeps local models near the global one when client data differ
(non-IID) or clients run different amounts of work; mu = 0 is FedAvg. Aggregation is FedAvg's.
"""

from __future__ import annotations

from plait.federated.strategies.base import Strategy


class FedProx(Strategy):
    name = "fedprox"

    def instructions(self, rnd: int) -> dict:
        return {**super().instructions(rnd), "mu": self.fed.mu}
