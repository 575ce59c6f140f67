"""Many federated clients in one process, for experiments: the server's Coordinator with clients called in turn.

    summary = simulate(cfg, "runs/fed")                       # one strategy, one run directory
    compare(cfg, "runs/cmp", ["fedavg", "fedsgd", "fedprox"])   # one run each + the combined report

The simulated round is the networked one without HTTP: the same Coordinator opens the round,
each sampled client asks it for its task, trains with the same `Client.train`, and uploads
(masked under secure aggregation); clients drawn to drop out (federated.sim_dropout) take their
task and never answer, so the quorum, deadline and mask-recovery paths run here too.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from plait.config import validate_config
from plait.federated.client import Client, FederatedData, build_client, federated_data
from plait.federated.report import RunRecorder, human, ratio_line, rounds_ratios, write_compare_report
from plait.federated.server import Coordinator, build_coordinator, round_line
from plait.runtime import mix_seed

if TYPE_CHECKING:
    from collections.abc import Callable

    from plait.config import Config


def run_round(coord: Coordinator, clients: dict[int, Client], available: list[int], drop_rng: np.random.Generator,
              dropout: float) -> dict:
    """One round: open, train every sampled client (some drop out), recover masks if needed, close."""
    plan = coord.open_round(available)
    for cid in plan.clients:
        task, weights = coord.task(cid)
        if task["status"] != "train":
            continue
        dropped = dropout > 0 and drop_rng.random() < dropout
        client = clients[cid]
        update = client.train(task["round"], weights, task["instructions"])
        if dropped:  # it trained (and under secure aggregation its peers masked against it) but never uploads
            continue
        if "peers" in task:
            peers = {int(k): int(v) for k, v in task["peers"].items()}
            try:
                masked = client.masked_upload(task["round"], update, task["instructions"], peers)
            except ValueError:  # cannot be encoded (non-finite, too large): the client drops out, as in run_client
                continue
            coord.submit(cid, task["round"], {"masked": torch.from_numpy(masked.view(np.int64))}, {"secagg": True})
        else:
            coord.submit(cid, task["round"], update.delta, {"num_samples": update.num_samples, "loss": update.loss})
    if coord.begin_recovery():
        for cid in list(coord.masked.received):
            task, _ = coord.task(cid)
            if task["status"] == "unmask":
                peers = {int(k): int(v) for k, v in task["peers"].items()}
                seeds = clients[cid].masking.reveal(task["round"], peers, task["dropped"], task["min_survivors"])
                coord.submit_unmask(cid, task["round"], seeds)
    return coord.close_round()


def simulate(cfg: Config, run_dir: str | Path | None, data: FederatedData | None = None, log: Callable | None = print) -> dict:
    """Run federated.rounds rounds of the configured strategy over federated.clients simulated clients."""
    fed = cfg.federated
    data = data or federated_data(cfg)
    coord = build_coordinator(cfg, data)
    recorder = RunRecorder(run_dir, cfg, data)
    # One model shared by all clients (they train one after another), separate from the server's evaluator.
    first = build_client(cfg, data, 0)
    clients = {0: first}
    for cid in range(1, fed.clients):
        clients[cid] = Client(cid, first.model, first.dataset, data.parts[cid], first.loss_fn, cfg.train.seed)
    for cid, c in clients.items():
        coord.register(cid, c.masking.public if fed.secure_aggregation else None)
    drop_rng = np.random.default_rng(mix_seed(cfg.train.seed, 7))
    everyone = sorted(clients)
    for _ in range(fed.rounds):
        record = run_round(coord, clients, everyone, drop_rng, fed.sim_dropout)
        recorder.write_round(record)
        if log:
            log(round_line(record, coord.plan.clients))
        if fed.stop_at_accuracy and record["test_accuracy"] >= fed.stop_at_accuracy:
            break
    coord.finish()
    summary = recorder.finish(coord.weights, coord.strategy.name)
    if log:
        log(f"done: {summary['rounds']} rounds of {summary['strategy']} in {summary['wall_time_s']:.1f}s, test accuracy "
            f"{human('test_accuracy', summary['test_accuracy'], summary)}; "
            f"{reached_90(summary['rounds_to_90'], summary['rounds'])}")
    return summary


def reached_90(hit: int | None, rounds: int) -> str:
    """When test accuracy first reached 90 %, in words."""
    return f"90 % test accuracy reached at round {hit}" if hit else f"90 % test accuracy not reached in {rounds} rounds"


def compare(cfg: Config, out_dir: str | Path, strategies: list[str], log: Callable | None = print) -> dict:
    """The same data, partition, model and seed under each strategy; writes out_dir/<strategy>/ and a combined report."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = federated_data(cfg)
    run_dirs = {}
    for name in strategies:
        c = copy.deepcopy(cfg)
        c.federated.strategy = name
        validate_config(c)
        if log:
            log(f"== {name}")
        simulate(c, out_dir / name, data, log)
        run_dirs[name] = out_dir / name
    summary = write_compare_report(out_dir, run_dirs)
    if log:
        for name, row in summary["strategies"].items():
            log(f"{name:>8}: rounds to 90 % {human('rounds_to_90', row['rounds_to_90'], row)}, final test accuracy "
                f"{human('test_accuracy', row['test_accuracy'], row)}")
        for k in rounds_ratios(summary["strategies"]):
            log(ratio_line(k.split("_over_")[0], summary["strategies"]))
    return summary
