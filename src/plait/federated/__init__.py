"""Federated learning: many data owners train one model without moving their data.

    plait fed simulate [CONFIG] --clients 100 [--set ...] [--out DIR]     # all clients in one process
    plait fed server CONFIG [--out DIR] [--token-file FILE]               # the coordinating server (HTTP)
    plait fed client --server HOST:PORT --client-id I CONFIG              # one data owner

Modules: server.py (the round state machine, shared by server and simulation), client.py
(local training and uploads), strategies/ (FedAvg, FedProx, FedAdam, FedSGD; the aggregators
mean / median / trimmed mean in combine.py, norm bounds in robust.py, the central-DP wrapper in
dp.py), partition.py, validate.py (update validation), secagg.py (pairwise masks), privacy.py
(the DP accountant), tensors.py (weights as data, update norms and clipping), transport.py
(HTTP), wire.py (what transport and server share: FederatedError, the task framing, tokens, the
RoundService the app serves), simulate.py, report.py (run directory and plots), cli.py.
"""
