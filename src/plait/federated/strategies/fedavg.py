"""FedAvg: clients run several epochs of local SGD; the server averages their models weighted by sample count.

McMahan, Moore, Ramage, Hampson, Agüera y Arcas 2017, "Communication-Efficient Learning of
Deep Networks from Decentralized Data" (AISTATS): w_{t+1} = sum_k n_k / n * w^k_{t+1}, which is
w_t plus the n_k-weighted mean of the clients' deltas (server_lr = 1).
"""

from __future__ import annotations

from plait.federated.strategies.base import Strategy


class FedAvg(Strategy):
    name = "fedavg"
