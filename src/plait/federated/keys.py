"""The [federated] section: the keys of `plait fed` (server, clients, strategies, privacy). Torch-free."""

from __future__ import annotations

from plait.config import keys, opt
from plait.errors import ConfigError


@keys("federated")
class FederatedKeys:
    strategy: str = opt("fedavg", "plait fed: fedavg, fedprox (+ mu), fedadam (server Adam) or fedsgd (the one-gradient baseline)",
                        ("fedavg", "fedprox", "fedadam", "fedsgd"))
    rounds: int = opt(30, "plait fed: communication rounds", minimum=1)
    clients: int = opt(10, "plait fed: data owners; the training set is partitioned into this many parts", minimum=1)
    clients_per_round: float = opt(1.0, "plait fed: clients sampled per round: a fraction (<= 1) or a count (> 1)",
                                   finite=True, above=0)
    min_clients: int = opt(2, "plait fed: quorum; a round with fewer valid updates by its deadline leaves the model as it is",
                           minimum=1)
    local_epochs: int = opt(2, "plait fed: passes over its own data each client makes per round (fedsgd: one full-batch gradient)",
                            minimum=1)
    local_batch_size: int = opt(16, "plait fed: samples per local SGD step", minimum=1)
    local_lr: float = opt(0.1, "plait fed: clients' SGD learning rate (fedsgd: the server's gradient step)", finite=True, above=0)
    local_momentum: float = opt(0.0, "plait fed: clients' SGD momentum (reset every round)", finite=True)
    mu: float = opt(0.01, "plait fed: fedprox proximal weight: clients add mu/2 * |w - w_global|^2 to their loss",
                    minimum=0, finite=True)
    server_lr: float = opt(0.0, "plait fed: server step on the averaged update; 0 = 1.0 (fedavg/fedprox/fedsgd) or 0.01 (fedadam)",
                           minimum=0, finite=True)
    server_betas: list = opt([0.9, 0.99], "plait fed: fedadam (beta1, beta2) of the server optimizer")
    server_tau: float = opt(1e-3, "plait fed: fedadam adaptivity tau (Adam's epsilon, Reddi et al. 2021)", finite=True, above=0)
    partition: str = opt("dirichlet", "plait fed: how the training set is split: iid, dirichlet (label skew, alpha) or shards",
                         ("iid", "dirichlet", "shards"))
    alpha: float = opt(0.5, "plait fed: Dirichlet concentration; small = each client sees few labels", finite=True, above=0)
    shards_per_client: int = opt(2, "plait fed: partition = shards: label-sorted shards each client gets", minimum=1)
    aggregator: str = opt("mean", "plait fed: combine updates by weighted mean, coordinate-wise median or trimmed_mean",
                          ("mean", "median", "trimmed_mean"))
    trim_fraction: float = opt(0.1, "plait fed: trimmed_mean: share of the largest and smallest values dropped per coordinate",
                               finite=True)
    clip_norm: float = opt(0.0, "plait fed: the server scales every update's L2 norm down to this (0: off)", minimum=0, finite=True)
    norm_bound: float = opt(3.0, "plait fed: updates above this multiple of the round's median norm are scaled to it, and one "
                            "against the round's coordinate-wise median to the median norm and weight (0: off)",
                            minimum=0, finite=True)
    secure_aggregation: bool = opt(False, "plait fed: pairwise-masked updates; the server learns only their sum (Bonawitz et al.)")
    secure_clip_norm: float = opt(10.0, "plait fed: secure aggregation: clients clip their updates to this L2 norm and the server "
                                  "refuses a sum beyond it, so no round moves the model further (clip_norm, if set, instead)",
                                  finite=True, above=0)
    dp_noise_multiplier: float = opt(0.0, "plait fed: client-level DP: Gaussian noise std / clip norm (0: no DP)",
                                     minimum=0, finite=True)
    dp_clip_norm: float = opt(1.0, "plait fed: client-level DP: each client's update is clipped to this L2 norm",
                              finite=True, above=0)
    dp_delta: float = opt(1e-5, "plait fed: client-level DP: the delta of the (epsilon, delta) reported per round", finite=True)
    round_deadline_s: float = opt(60.0, "plait fed server: seconds a round waits for its clients before using the quorum",
                                  finite=True, above=0)
    start_timeout_s: float = opt(300.0, "plait fed server: seconds to wait for all clients to connect (then: the quorum suffices)",
                                 finite=True, above=0)
    heartbeat_timeout_s: float = opt(10.0, "plait fed server: a client silent this long is not sampled", finite=True, above=0)
    host: str = opt("127.0.0.1", "plait fed server: address to bind (0.0.0.0 to accept other machines)")
    port: int = opt(8470, "plait fed server: TCP port (0: any free port, written to RUN_DIR/endpoint.json)", minimum=0)
    stop_at_accuracy: float = opt(0.0, "plait fed: end the run once test accuracy reaches this (0: run every round)",
                                  minimum=0, finite=True)
    sim_dropout: float = opt(0.0, "plait fed simulate: chance that a sampled client drops out mid-round", finite=True)

    def check(self, cfg) -> None:
        """The combinations a federated round cannot run."""
        n = self.clients_per_round
        if n > 1 and (n != int(n) or n > self.clients):
            raise ConfigError(
                f"federated.clients_per_round = {self.clients_per_round}: above 1 it is a count of clients and must be a whole "
                f"number <= federated.clients ({self.clients}); or give a fraction in (0, 1]"
            )
        if self.min_clients > self.clients:
            raise ConfigError(f"federated.min_clients ({self.min_clients}) must be <= federated.clients ({self.clients})")
        if self.port > 65535:
            raise ConfigError(f"federated.port = {self.port} must be in 0..65535")
        if not 0 <= self.trim_fraction < 0.5:
            raise ConfigError(f"federated.trim_fraction = {self.trim_fraction} must be in [0, 0.5)")
        if not (0 < self.dp_delta < 1):
            raise ConfigError(f"federated.dp_delta = {self.dp_delta} must be in (0, 1)")
        if not (0 <= self.sim_dropout < 1) or not (0 <= self.local_momentum < 1) or self.stop_at_accuracy > 1:
            raise ConfigError(
                f"federated.sim_dropout ({self.sim_dropout}) and federated.local_momentum ({self.local_momentum}) must be in "
                f"[0, 1), "
                f"federated.stop_at_accuracy ({self.stop_at_accuracy}) in [0, 1]"
            )
        if len(self.server_betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.server_betas):
            raise ConfigError(f"federated.server_betas = {self.server_betas} must be two numbers in [0, 1), e.g. [0.9, 0.99]")
        if self.partition == "shards" and self.clients * self.shards_per_client < 1:
            raise ConfigError("federated.partition = 'shards' needs clients * shards_per_client >= 1")
        if self.secure_aggregation and self.aggregator != "mean":
            raise ConfigError(
                f"federated.aggregator = {self.aggregator!r} needs each update in the clear, but "
                "federated.secure_aggregation = true "
                "shows the server only their sum; set federated.aggregator='mean' or secure_aggregation=false"
            )
        if self.dp_noise_multiplier > 0 and self.aggregator != "mean":
            raise ConfigError(
                f"federated.aggregator = {self.aggregator!r} with differential privacy: the accountant covers the noised "
                "mean only; "
                "set federated.aggregator='mean' or federated.dp_noise_multiplier=0"
            )
