"""The federated server's round logic, shared by `plait fed server` (over HTTP) and `plait fed simulate`.

`Coordinator` is a state machine that never touches the network: open a round (the strategy
samples clients and writes their instructions), hand out tasks, accept or reject uploads, run
secure-aggregation recovery when masked clients dropped, then close the round (the strategy
aggregates, within its norm bounds and with DP noise when it was built so; then evaluate).
Every input from a client goes through `submit`/`submit_unmask`, which answer (accepted,
reason) and never raise: a hostile or broken client can waste its own slot, not stop the
server. The transport (transport.py) and the simulation (simulate.py) only move these plain
values around.

A client's weight in the mean is its sample count, which the client reports. When the
coordinator knows each client's partition (`sizes`: plait's server rebuilds the same partition
as its clients) a count above the client's own partition is rejected. Without `sizes` (data
owners with data the server cannot see) each count is capped at WEIGHT_CAP times the round's
lower median count. Under secure aggregation each client clips its update to the round's
announced bound B and the server checks the unmasked sum (`check_masked_total`): a total weight
below one per client or above the survivors' samples, or a sum longer than total weight x B,
skips the round with the reason, the model kept, so the next round's clients train and encode as
before; a sum that passes moves the model by at most B. Under secure aggregation the public keys are
frozen when a round opens; a participant that registers again with another key during the
round makes its masks unable to cancel, so that round is skipped, never summed wrong.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from plait.federated.client import FederatedData, federated_data, fingerprint
from plait.federated.report import RunRecorder
from plait.federated.secagg import FRAC_BITS, MaskedSum, check_public_key
from plait.federated.strategies import ClientUpdate, RoundPlan, Strategy, build_strategy
from plait.federated.tensors import Weights, encode, get_weights, set_weights
from plait.federated.transport import HTTPServerThread, make_app
from plait.federated.validate import check_update
from plait.federated.wire import FederatedError
from plait.models import build_model
from plait.runtime import pick_device
from plait.train.loss import loss_for

if TYPE_CHECKING:
    from pathlib import Path

    from plait.config import Config, FederatedConfig

Evaluate = Callable[[Weights], tuple[float, float]]
WEIGHT_CAP = 4.0  # without known partition sizes: no client weighs more than this times the round's lower median count


def make_evaluator(model: torch.nn.Module, dataset, loss_fn, batch_size: int = 512) -> Evaluate:
    """(mean loss, accuracy) of given weights on a held-out dataset."""
    device = next(model.parameters()).device

    @torch.no_grad()
    def evaluate(weights: Weights) -> tuple[float, float]:
        set_weights(model, weights)
        model.eval()
        loss_sum, correct, n = 0.0, 0, 0
        for idx in torch.arange(len(dataset)).split(batch_size):
            x, y = dataset.fetch(idx)
            x, y = x.to(device), y.to(device)
            logits = model(x)
            loss_sum += float(loss_fn(logits, y)) * len(idx)
            correct += int((logits.argmax(-1) == y).sum())
            n += len(idx)
        return loss_sum / max(1, n), correct / max(1, n)

    return evaluate


class Coordinator:
    """One federated run's server state: the global weights and the round in progress (thread-safe)."""

    def __init__(self, fed: FederatedConfig, weights: Weights, strategy: Strategy, evaluate: Evaluate, seed: int,
                 sizes: dict[int, int] | None = None):
        self.fed, self.weights, self.strategy, self.evaluate = fed, weights, strategy, evaluate
        self.sizes = sizes  # each client's partition size, when the server knows it
        self.secure = bool(fed.secure_aggregation)
        self.length = sum(v.numel() for v in weights.values())
        self.rng = np.random.default_rng(seed)
        self.lock = threading.RLock()
        self.public_keys: dict[int, int] = {}
        self.round_keys: dict[int, int] = {}  # the keys of the round's participants, frozen when it opens
        self.rekeyed: set[int] = set()  # participants that registered again with another key during the round
        self.seen: dict[int, float] = {}
        self.told_done: set[int] = set()
        self.round = 0
        self.phase = "idle"  # idle -> train (-> unmask) -> idle ... -> done
        self.plan: RoundPlan | None = None
        self.updates: dict[int, ClientUpdate] = {}
        self.rejected: dict[int, str] = {}
        self.masked: MaskedSum | None = None
        self.started = 0.0
        self._blob: tuple[int, bytes] | None = None

    # ----------------------------------------------------------------- clients

    def register(self, client_id: int, public_key: int | None = None) -> None:
        """A client (re)joins; raises ValueError for a public key outside the group (or none, under secure aggregation)."""
        if public_key is not None:
            check_public_key(public_key)
        elif self.secure:
            raise ValueError("secure aggregation needs the client's public key")
        with self.lock:
            if public_key is not None:
                if (self.masked is not None and self.phase in ("train", "unmask") and client_id in self.round_keys
                        and self.round_keys[client_id] != public_key):
                    self.rekeyed.add(client_id)  # its masks in this round can no longer cancel
                self.public_keys[client_id] = public_key
            self.seen[client_id] = time.monotonic()

    def alive(self, within_s: float) -> list[int]:
        now = time.monotonic()
        with self.lock:
            return sorted(c for c, t in self.seen.items() if now - t <= within_s)

    def status(self) -> dict:
        """The round in progress, for monitoring (GET /v1/status)."""
        with self.lock:
            plan = self.plan
            return {"round": self.round, "phase": self.phase, "selected": plan.clients if plan else [],
                    "received": sorted(self.updates) if self.masked is None else sorted(self.masked.received),
                    "alive": self.alive(self.fed.heartbeat_timeout_s)}

    def weights_blob(self) -> bytes:
        """The current global weights as a wire message, encoded once per round."""
        with self.lock:
            if self._blob is None or self._blob[0] != self.round:
                self._blob = (self.round, encode(self.weights))
            return self._blob[1]

    def task(self, client_id: int) -> tuple[dict, Weights | None]:
        """What this client should do now: train (with the weights), unmask, wait, or stop."""
        with self.lock:
            self.seen[client_id] = time.monotonic()
            if self.phase == "done":
                self.told_done.add(client_id)
                return {"status": "done", "round": self.round}, None
            plan = self.plan
            if self.phase == "train" and plan and client_id in plan.clients and not self._submitted(client_id):
                task = {"status": "train", "round": self.round, "instructions": plan.instructions}
                if self.secure:
                    task["peers"] = {str(c): str(self.round_keys[c]) for c in plan.clients}
                return task, self.weights
            if self.phase == "unmask" and self.masked and client_id in self.masked.received \
                    and client_id not in self.masked.recovered:
                return {"status": "unmask", "round": self.round, "dropped": self.masked.dropped,
                        "min_survivors": self.fed.min_clients,
                        "peers": {str(c): str(self.round_keys[c]) for c in self.masked.participants}}, None
            return {"status": "wait", "round": self.round}, None

    def _submitted(self, client_id: int) -> bool:
        if self.masked is not None:
            return client_id in self.masked.received or client_id in self.rejected
        return client_id in self.updates or client_id in self.rejected

    # ----------------------------------------------------------------- rounds

    def open_round(self, available: list[int]) -> RoundPlan:
        """Start the next round among `available` clients (those with keys, under secure aggregation)."""
        with self.lock:
            self.round += 1
            if self.secure:
                available = [c for c in available if c in self.public_keys]
            plan = self.strategy.configure_round(self.round, available, self.rng)
            if self.secure and "clip_norm" not in plan.instructions:
                # The server cannot bound masked updates, so clients bound their own (a DP wrapper's bound S stays) and
                # the server checks the unmasked sum against that bound (check_masked_total).
                bound = self.fed.clip_norm or self.fed.secure_clip_norm
                plan = RoundPlan(plan.round, plan.clients, {**plan.instructions, "clip_norm": bound})
            self.plan = plan
            self.updates, self.rejected = {}, {}
            self.round_keys = {c: self.public_keys[c] for c in plan.clients} if self.secure else {}
            self.rekeyed = set()
            self.masked = MaskedSum(plan.clients, self.length + 1) if self.secure else None
            self.phase, self.started = "train", time.monotonic()
            return self.plan

    def submit(self, client_id: int, rnd: int, tensors: Weights, meta: dict) -> tuple[bool, str]:
        """Take one client's upload for round `rnd`; (accepted, reason). Never raises."""
        try:
            with self.lock:
                if client_id in self.seen:  # a client busy training is alive too
                    self.seen[client_id] = time.monotonic()
                return self._submit(client_id, rnd, tensors, meta)
        except Exception as e:  # a malformed upload must not take the server down
            with self.lock:
                self.rejected.setdefault(client_id, f"unusable upload: {e}")
            return False, f"unusable upload: {e}"

    def _submit(self, client_id: int, rnd: int, tensors: Weights, meta: dict) -> tuple[bool, str]:
        if self.phase != "train" or rnd != self.round or self.plan is None:
            return False, f"round {rnd} is not open (the server is at round {self.round}, {self.phase})"
        if client_id not in self.plan.clients:
            return False, f"client {client_id} was not sampled in round {rnd}"
        if self._submitted(client_id):
            return False, f"client {client_id} already uploaded in round {rnd}"
        if self.masked is not None:
            t = tensors.get("masked")
            if set(tensors) != {"masked"} or t is None or t.dtype != torch.int64 or tuple(t.shape) != (self.length + 1,):
                reason = f"a secure-aggregation upload must be one int64 tensor 'masked' of {self.length + 1} values"
                self.rejected[client_id] = reason
                return False, reason
            self.masked.add(client_id, t.numpy().view(np.uint64).copy())
            return True, "accepted"
        n = meta.get("num_samples")
        loss = meta.get("loss")
        loss = float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else math.nan
        update = ClientUpdate(client_id, n, dict(tensors), loss)
        reason = check_update(update, self.weights)
        if not reason and self.sizes is not None and n > self.sizes.get(client_id, 0):
            reason = f"num_samples {n} is more than client {client_id}'s partition holds ({self.sizes.get(client_id, 0)})"
        if reason:
            self.rejected[client_id] = reason
            return False, reason
        update.delta = {k: update.delta[k].to(v.dtype) for k, v in self.weights.items()}  # the model's order
        self.updates[client_id] = update
        return True, "accepted"

    def all_in(self) -> bool:
        with self.lock:
            return self.plan is not None and all(self._submitted(c) for c in self.plan.clients)

    def begin_recovery(self) -> bool:
        """Secure aggregation with dropped clients and a quorum of survivors: ask survivors for seeds."""
        with self.lock:
            m = self.masked
            if m is None or not m.dropped or len(m.received) < self.fed.min_clients:
                return False
            self.phase = "unmask"
            return True

    def submit_unmask(self, client_id: int, rnd: int, seeds: dict) -> tuple[bool, str]:
        try:
            with self.lock:
                if self.phase != "unmask" or rnd != self.round or self.masked is None:
                    return False, f"no recovery open for round {rnd}"
                self.masked.recover(client_id, {int(d): int(s) for d, s in seeds.items()})
                return True, "accepted"
        except Exception as e:
            return False, f"unusable recovery: {e}"

    def recovery_done(self) -> bool:
        with self.lock:
            return self.masked is None or self.masked.complete

    def _aggregate(self) -> tuple[Weights, list[int]]:
        """The strategy's new weights from what arrived, and whose updates its norm bounds scaled down."""
        if self.masked is not None:
            if self.rekeyed:
                raise ValueError(f"client(s) {sorted(self.rekeyed)} registered again with a new key during the round, so "
                                 "the masks cannot cancel; the round is skipped (never a wrong sum)")
            vec = self.masked.result()
            total = check_masked_total(vec, len(self.masked.received), self.plan.instructions, self._most_weight())
            return self.strategy.aggregate_sum(self.round, self.weights, vec[:-1], total), []
        # Client-id order, not arrival order: the float sum (and so the run) does not depend on network timing.
        updates = [self.updates[c] for c in sorted(self.updates)]
        if self.sizes is None:
            updates = cap_weights(updates)
        new = self.strategy.aggregate(self.round, self.weights, updates)
        return new, self.strategy.clipped()

    def _most_weight(self) -> float | None:
        """What the masked sum's clients may weigh together: their partitions' samples, when the server knows them."""
        if self.sizes is None:
            return None
        return float(sum(self.sizes.get(c, 0) for c in self.masked.received))

    def close_round(self) -> dict:
        """Aggregate what arrived (if a quorum did), evaluate, and return the round's metrics record."""
        with self.lock:
            plan = self.plan
            received = list(self.masked.received) if self.masked is not None else sorted(self.updates)
            dropped = [c for c in plan.clients if c not in received and c not in self.rejected]
            record: dict = {"round": self.round, "selected": len(plan.clients), "clients": len(received),
                            "dropped": dropped, "rejected": {str(c): r for c, r in sorted(self.rejected.items())}}
            skipped = None
            if len(received) < self.fed.min_clients:
                skipped = f"{len(received)} valid updates, quorum is federated.min_clients = {self.fed.min_clients}"
            else:
                try:
                    new, record["clipped"] = self._aggregate()
                    if all(bool(torch.isfinite(v).all()) for v in new.values()):
                        self.weights = new
                    else:
                        skipped = "the aggregate is not finite"
                except ValueError as e:
                    skipped = str(e)
            if skipped:
                record["skipped"] = skipped
                record["clients"] = 0
            losses = [(u.loss, u.num_samples) for u in self.updates.values() if math.isfinite(u.loss)]
            if losses:
                record["train_loss"] = sum(loss * n for loss, n in losses) / sum(n for _, n in losses)
            record["test_loss"], record["test_accuracy"] = self.evaluate(self.weights)
            eps = self.strategy.epsilon()
            if eps is not None:
                record["epsilon"] = eps
            record["round_time_s"] = time.monotonic() - self.started
            self.phase = "idle"
            return record

    def finish(self) -> None:
        with self.lock:
            self.phase = "done"


def check_masked_total(vec: torch.Tensor, clients: int, instructions: dict, most: float | None) -> float:
    """The unmasked sum [sum_k w_k delta_k, sum_k w_k] of `clients` uploads: its total weight, once it is within what
    honest clients can send; ValueError (the round is skipped, the model kept) when it is not.

    Every honest client weighs 1 (DP: exactly 1) up to its partition (`most` together, when the server knows the
    partitions) and clipped its update to instructions["clip_norm"] = B, so honestly
    clients <= total <= most and |sum_k w_k delta_k| <= total * B. Only the sum is seen: this bounds the round,
    not each client (see secagg.py).
    """
    total = float(vec[-1])
    if instructions.get("unweighted") and abs(total - clients) > 0.5:
        raise ValueError(f"the masked sum's total weight {total:.6g} is not {clients}, one per client: a client sent "
                         "another weight; the round is skipped")
    if most is not None and total > most + 0.5:
        raise ValueError(f"the masked sum's total weight {total:.6g} is more than the {most:.0f} samples its "
                         "clients hold: a client claimed more than its partition")
    if not total >= clients - 0.5:
        raise ValueError(f"the masked sum's total weight {total:.6g} is below {clients}, the least {clients} clients "
                         "weigh (at least 1 each): a client sent a weight below 1; the round is skipped")
    bound = float(instructions["clip_norm"])
    size = float(vec[:-1].norm())
    slack = clients * math.sqrt(len(vec)) * 2.0**-FRAC_BITS  # the fixed-point rounding of every upload
    if not size <= total * bound * (1 + 1e-6) + slack:
        raise ValueError(f"the masked sum's norm {size:.6g} is more than its total weight times the clients' bound "
                         f"({total:.6g} x {bound:.6g}): a client sent an update beyond the bound; the round is skipped")
    return total


def cap_weights(updates: list[ClientUpdate], cap: float = WEIGHT_CAP) -> list[ClientUpdate]:
    """Each sample count at most `cap` times the lower median count of the round (for clients whose size is unknown)."""
    if len(updates) < 2:
        return updates
    counts = sorted(u.num_samples for u in updates)
    limit = max(1, int(cap * counts[(len(counts) - 1) // 2]))
    return [u if u.num_samples <= limit else ClientUpdate(u.client_id, limit, u.delta, u.loss) for u in updates]


def build_coordinator(cfg: Config, data: FederatedData, generator: torch.Generator | None = None) -> Coordinator:
    """A configured run's coordinator: initial model (seeded by train.seed), strategy (DP noise from `generator`), evaluator."""
    fed = cfg.federated
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, data.bundle.spec).to(pick_device(cfg.launch.device, 0))
    weights = get_weights(model)
    evaluate = make_evaluator(model, data.bundle.val, loss_for(data.bundle.spec))
    sizes = {c: len(p) for c, p in enumerate(data.parts)}  # the same partition the clients train on
    return Coordinator(fed, weights, build_strategy(fed, generator=generator), evaluate, seed=cfg.train.seed, sizes=sizes)


def wait_until(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= end:
            return False
        time.sleep(poll_s)
    return True


def serve(cfg: Config, run_dir: str | Path, tokens: dict, ssl_certfile: str | None = None, ssl_keyfile: str | None = None,
          log: Callable[[str], None] = print) -> dict:
    """The `plait fed server` process: HTTP on federated.host:port, rounds until federated.rounds; returns the summary."""
    fed = cfg.federated
    data = federated_data(cfg)
    coord = build_coordinator(cfg, data)
    recorder = RunRecorder(run_dir, cfg, data)
    app = make_app(coord, tokens, fingerprint(cfg))
    http = HTTPServerThread(app, fed.host, fed.port, ssl_certfile, ssl_keyfile)
    port = http.start()
    recorder.write_endpoint(fed.host, port, tls=bool(ssl_certfile))
    log(f"plait fed server on {'https' if ssl_certfile else 'http'}://{fed.host}:{port}; waiting for {fed.clients} clients "
        f"(at least {fed.min_clients})")
    try:
        # All data owners are expected; after start_timeout_s the run starts with whoever came, if a quorum did.
        wait_until(lambda: len(coord.alive(fed.heartbeat_timeout_s)) >= fed.clients, fed.start_timeout_s)
        if len(coord.alive(fed.heartbeat_timeout_s)) < fed.min_clients:
            raise FederatedError(
                f"only {len(coord.alive(fed.heartbeat_timeout_s))} of federated.min_clients = {fed.min_clients} clients "
                f"connected within federated.start_timeout_s = {fed.start_timeout_s}s; start more clients or lower min_clients"
            )
        for _ in range(fed.rounds):
            wait_until(lambda: len(coord.alive(fed.heartbeat_timeout_s)) >= fed.min_clients, fed.round_deadline_s)
            plan = coord.open_round(coord.alive(fed.heartbeat_timeout_s))
            wait_until(coord.all_in, fed.round_deadline_s)
            if coord.begin_recovery():
                wait_until(coord.recovery_done, fed.round_deadline_s)
            record = coord.close_round()
            recorder.write_round(record)
            log(round_line(record, plan.clients))
            if fed.stop_at_accuracy and record["test_accuracy"] >= fed.stop_at_accuracy:
                break
        coord.finish()
        # Let clients that are still polling learn that the run is over before the port closes.
        wait_until(lambda: set(coord.alive(fed.heartbeat_timeout_s)) <= coord.told_done, 5.0)
        return recorder.finish(coord.weights, coord.strategy.name)
    finally:
        coord.finish()
        http.stop()


def round_line(record: dict, clients: list[int]) -> str:
    extra = f" skipped: {record['skipped']}" if record.get("skipped") else ""
    if record.get("dropped"):
        extra += f" dropped {record['dropped']}"
    if record.get("rejected"):
        extra += f" rejected {sorted(map(int, record['rejected']))}"
    eps = f" eps {record['epsilon']:.3g}" if "epsilon" in record else ""
    return (f"round {record['round']:>4}: test acc {100 * record['test_accuracy']:.1f} % loss {record['test_loss']:.4f} "
            f"clients {record['clients']}/{len(clients)}{eps}{extra}")
