"""A federated client: its own share of the data, local training, and what it uploads.

`local_update` is the whole of a client's computation in a round (FedAvg/FedProx local SGD, or
FedSGD's one full-batch gradient); `Client` wraps it with the client's data and the upload
rules the round's instructions ask for (clipping, secure-aggregation masks); `run_client` is the
process `plait fed client` runs: poll the server for work, train, upload, until the run ends.

Each client process rebuilds the same partition from the shared config and takes part
`client_id` as "its own" data (see plait.federated.partition); a real deployment would point
each client's `[data]` at its own files instead.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn as nn

from plait.data import build_data
from plait.errors import ConfigError
from plait.federated.partition import partition
from plait.federated.secagg import MaskingClient
from plait.federated.strategies.base import ClientUpdate
from plait.federated.tensors import Weights, clip, flatten, get_weights, set_weights
from plait.federated.transport import FedHTTPClient
from plait.models import build_model
from plait.runtime import mix_seed, pick_device
from plait.train.loss import loss_for

if TYPE_CHECKING:
    from plait.config import Config

FULL_BATCH_CHUNK = 1024  # samples per forward pass when a client computes a full-batch gradient


@dataclass
class FederatedData:
    """The datasets and every client's sample indices (the same on every process)."""

    bundle: object
    parts: list[np.ndarray]
    labels: np.ndarray


def federated_data(cfg: Config) -> FederatedData:
    """Load the configured data and partition its training set over federated.clients clients."""
    bundle = build_data(cfg.data, cfg.model)
    if bundle.spec.task != "classification" or not isinstance(getattr(bundle.train, "y", None), torch.Tensor):
        raise ConfigError(
            f"plait fed partitions data by label, so it needs a classification source with one label per sample "
            f"(digits, synthetic, tensors); data.name = {cfg.data.name!r} is not one; change data.name"
        )
    f = cfg.federated
    labels = bundle.train.y.numpy()
    parts = partition(labels, f.clients, f.partition, f.alpha, f.shards_per_client, seed=cfg.train.seed)
    return FederatedData(bundle, parts, labels)


def local_update(model: nn.Module, weights: Weights, dataset, indices: np.ndarray, instructions: dict, loss_fn,
                 seed: int) -> tuple[Weights, float]:
    """Train from the global `weights` on this client's samples as instructed; returns (delta, mean loss).

    mode "local": `epochs` passes of SGD (lr, momentum) over shuffled batches of `batch_size`, with
    FedProx's proximal term mu/2 |w - w_global|^2 added to each batch's loss when mu > 0.
    mode "gradient": one full-batch gradient g; delta = -lr * g (FedSGD).
    """
    set_weights(model, weights)
    model.train()
    device = next(model.parameters()).device
    idx = torch.tensor(np.asarray(indices), dtype=torch.long)  # a copy: partitions may be read-only arrays
    params = [p for p in model.parameters() if p.requires_grad]
    if instructions["mode"] == "gradient":
        model.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in idx.split(FULL_BATCH_CHUNK):
            x, y = dataset.fetch(chunk)
            loss = loss_fn(model(x.to(device)), y.to(device)) * (len(chunk) / len(idx))
            loss.backward()
            total += float(loss.detach())
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.sub_(instructions["lr"] * p.grad)
        losses = [total]
    else:
        g = torch.Generator().manual_seed(seed)
        opt = torch.optim.SGD(params, lr=instructions["lr"], momentum=instructions.get("momentum", 0.0))
        mu = float(instructions.get("mu", 0.0))
        anchor = [p.detach().clone() for p in params] if mu > 0 else None
        losses = []
        for _ in range(int(instructions["epochs"])):
            for batch in idx[torch.randperm(len(idx), generator=g)].split(int(instructions["batch_size"])):
                x, y = dataset.fetch(batch)
                loss = loss_fn(model(x.to(device)), y.to(device))
                losses.append(float(loss.detach()))
                if anchor is not None:
                    loss = loss + mu / 2 * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
    new = get_weights(model)
    delta = {k: new[k] - weights[k].to(new[k].dtype) for k in weights}
    return delta, float(np.mean(losses)) if losses else math.nan


class Client:
    """One data owner: its samples, a model to train on them, and its secure-aggregation keys."""

    def __init__(self, client_id: int, model: nn.Module, dataset, indices: np.ndarray, loss_fn, seed: int):
        self.client_id = client_id
        self.model, self.dataset, self.indices, self.loss_fn, self.seed = model, dataset, indices, loss_fn, seed
        self.masking = MaskingClient(client_id)

    @property
    def num_samples(self) -> int:
        return len(self.indices)

    def train(self, rnd: int, weights: Weights, instructions: dict) -> ClientUpdate:
        seed = mix_seed(self.seed, rnd, self.client_id)
        delta, loss = local_update(self.model, weights, self.dataset, self.indices, instructions, self.loss_fn, seed)
        clip_to = float(instructions.get("clip_norm", 0.0))
        if clip_to > 0:  # DP (and secure aggregation with clipping) need the client to bound its own update
            delta, _ = clip(delta, clip_to)
        return ClientUpdate(self.client_id, self.num_samples, delta, loss)

    def warm_up(self) -> None:
        """One throwaway SGD step, so that first-use costs (lazy imports in torch.optim, allocator warm-up) are
        paid before the client joins rather than inside its first round's deadline."""
        weights = get_weights(self.model)
        ins = {"mode": "local", "epochs": 1, "batch_size": 2, "lr": 0.0, "momentum": 0.0, "mu": 0.0}
        local_update(self.model, weights, self.dataset, self.indices[:2], ins, self.loss_fn, 0)
        set_weights(self.model, weights)

    def masked_upload(self, rnd: int, update: ClientUpdate, instructions: dict, peers: dict[int, int]) -> np.ndarray:
        """Secure aggregation: [w * delta, w] masked, with w = num_samples (or 1 under DP) and delta within the round's
        clip_norm (the bound the server checks the sum against); ValueError for what cannot be encoded."""
        w = 1.0 if instructions.get("unweighted") else float(update.num_samples)
        bound = float(instructions.get("clip_norm") or 0.0)
        delta = clip(update.delta, bound)[0] if bound > 0 else update.delta
        vec = torch.cat([flatten(delta) * w, torch.tensor([w], dtype=torch.float64)])
        return self.masking.masked(vec, rnd, peers)


def build_client(cfg: Config, data: FederatedData, client_id: int) -> Client:
    """The client `client_id` of the configured run (model initialised like the server's; weights come from it)."""
    if not 0 <= client_id < len(data.parts):
        raise ConfigError(f"--client-id {client_id} must be in 0..{len(data.parts) - 1} (federated.clients = {len(data.parts)})")
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, data.bundle.spec).to(pick_device(cfg.launch.device, 0))
    return Client(client_id, model, data.bundle.train, data.parts[client_id], loss_for(data.bundle.spec), cfg.train.seed)


def run_client(cfg: Config, server: str, client_id: int, token: str, ca_file: str | None = None, poll_s: float = 0.2,
               connect_timeout_s: float = 60.0) -> int:
    """The `plait fed client` process: register, then train whenever the server has a task, until it says done."""
    data = federated_data(cfg)
    client = build_client(cfg, data, client_id)
    client.warm_up()
    http = FedHTTPClient(server, token, ca_file=ca_file)
    try:
        http.register(client_id, client.masking.public, fingerprint(cfg), connect_timeout_s)
        done_rounds, sat_out = 0, -1
        while True:
            task, weights = http.task(client_id)
            status = task.get("status")
            if status == "done":
                print(f"client {client_id}: server finished after round {task.get('round')}; trained {done_rounds} rounds")
                return 0
            if status == "train" and int(task["round"]) != sat_out:
                rnd, ins = int(task["round"]), task["instructions"]
                update = client.train(rnd, weights, ins)
                if task.get("peers"):
                    peers = {int(k): int(v) for k, v in task["peers"].items()}
                    try:
                        masked = client.masked_upload(rnd, update, ins, peers)
                    except ValueError as e:  # an update that cannot be encoded: this client sits the round out
                        print(f"client {client_id}: round {rnd} not uploaded: {e}")
                        sat_out = rnd
                        continue
                    http.upload(client_id, rnd, {"masked": torch.from_numpy(masked.view(np.int64))}, {"secagg": True})
                else:
                    http.upload(client_id, rnd, update.delta, {"num_samples": update.num_samples, "loss": update.loss})
                done_rounds += 1
            elif status == "unmask":
                rnd = int(task["round"])
                peers = {int(k): int(v) for k, v in task["peers"].items()}
                seeds = client.masking.reveal(rnd, peers, [int(d) for d in task["dropped"]], int(task["min_survivors"]))
                http.unmask(client_id, rnd, seeds)
            else:
                time.sleep(poll_s)
    finally:
        http.close()


def fingerprint(cfg: Config) -> str:
    """What server and clients must agree on (model, data, partition, seed), as a short hash."""
    import dataclasses
    import hashlib
    import json

    f = cfg.federated
    key = {"model": dataclasses.asdict(cfg.model), "data": dataclasses.asdict(cfg.data), "seed": cfg.train.seed,
           "partition": [f.clients, f.partition, f.alpha, f.shards_per_client]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
