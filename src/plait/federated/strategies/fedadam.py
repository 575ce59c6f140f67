"""FedAdam: FedAvg's clients, with Adam on the server applied to the averaged delta (the pseudo-gradient).

Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan 2021, "Adaptive Federated
Optimization" (ICLR), Algorithm 2: with Delta_t the mean client delta,
m_t = b1 m + (1 - b1) Delta_t,  v_t = b2 v + (1 - b2) Delta_t^2,  x += eta m_t / (sqrt(v_t) + tau).
No bias correction (as in the paper); tau sets the degree of adaptivity.
"""

from __future__ import annotations

import torch

from plait.federated.strategies.base import Strategy
from plait.federated.tensors import Weights


class FedAdam(Strategy):
    name = "fedadam"
    default_server_lr = 0.01

    def __init__(self, fed, combine):
        super().__init__(fed, combine)
        self.beta1, self.beta2 = (float(b) for b in fed.server_betas)
        self.tau = fed.server_tau
        self.m: Weights = {}
        self.v: Weights = {}

    def step(self, rnd: int, weights: Weights, delta: Weights) -> Weights:
        """Adam on the pseudo-gradient `delta` (Reddi et al. 2021, Algorithm 2)."""
        out = {}
        for k, w in weights.items():
            d = delta[k].double()
            m = self.beta1 * self.m.get(k, torch.zeros_like(d)) + (1 - self.beta1) * d
            v = self.beta2 * self.v.get(k, torch.zeros_like(d)) + (1 - self.beta2) * d * d
            self.m[k], self.v[k] = m, v
            out[k] = (w.double() + self.server_lr * m / (v.sqrt() + self.tau)).to(w.dtype)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**{f"m.{k}": v for k, v in self.m.items()}, **{f"v.{k}": v for k, v in self.v.items()}}
