"""plait fed simulate against Flower (flwr 1.42) on the same model, data, partition, seed and local training.

Run with the benchmark venv (Flower is a benchmark-only dependency; plait never imports it):

    python3 -m venv .venv-bench
    .venv-bench/bin/pip install torch==2.13.0 'flwr[simulation]==1.42.*' scikit-learn safetensors
    .venv-bench/bin/python benchmarks/fed_vs_flower.py [--rounds 30] [--clients 10]

The plait side runs `plait fed simulate` in plait's own venv (.venv, or --plait-python) as a
subprocess; the Flower side runs here with Flower's simulation runtime (ServerApp + ClientApp,
Ray backend, message-API FedAvg), taking plait's data split, Dirichlet partition, initial weights
and local SGD routine from plait's sources so that only the framework differs. (Flower's
deployment runtime would also work; its SuperLink would then need
--disable-runtime-dependency-installation to not install the app's dependencies itself.)
Prints rounds to 90 % test accuracy and wall time for each; the baseline is Flower.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # plait's data, model, partition and local SGD (no flwr inside plait)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))  # Ray workers
os.environ.setdefault("OMP_NUM_THREADS", "1")


def plait_side(args, out: Path) -> dict:
    """`plait fed simulate` in plait's venv; wall time includes its start-up."""
    cmd = [args.plait_python, "-m", "plait", "fed", "simulate", "--out", str(out), "--rounds", str(args.rounds),
           "--clients", str(args.clients), "--set", "log.report=false", "--set", f"train.seed={args.seed}"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    summary = json.loads((out / "summary.json").read_text())
    acc = [json.loads(line)["test_accuracy"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"rounds_to_90": summary["rounds_to_90"], "final_accuracy": summary["test_accuracy"], "wall_s": wall,
            "rounds_s": summary["wall_time_s"], "curve": acc}


def flower_side(args) -> dict:
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    from plait.config import load_config
    from plait.federated.client import federated_data, local_update
    from plait.models import build_model
    from plait.runtime import mix_seed
    from plait.train.loss import loss_for

    cfg = load_config(None, ["model.name='mlp'", "data.name='digits'",  # what `plait fed simulate` sets with no config
                             f"federated.clients={args.clients}", f"train.seed={args.seed}"])
    fed = cfg.federated
    data = federated_data(cfg)
    spec, loss_fn = data.bundle.spec, loss_for(data.bundle.spec)
    instructions = {"mode": "local", "epochs": fed.local_epochs, "batch_size": fed.local_batch_size, "lr": fed.local_lr,
                    "momentum": fed.local_momentum, "mu": 0.0}

    def model():
        torch.manual_seed(cfg.train.seed)
        return build_model(cfg.model, spec)

    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        cid = int(context.node_config["partition-id"])
        net = model()
        weights = {k: torch.as_tensor(v) for k, v in msg.content["arrays"].to_torch_state_dict().items()}
        rnd = int(msg.content["config"]["server-round"])
        delta, loss = local_update(net, weights, data.bundle.train, data.parts[cid], instructions, loss_fn,
                                   mix_seed(cfg.train.seed, rnd, cid))
        new = {k: weights[k] + delta[k] for k in weights}
        content = RecordDict({"arrays": ArrayRecord(new),
                              "metrics": MetricRecord({"train_loss": loss, "num-examples": len(data.parts[cid])})})
        return Message(content=content, reply_to=msg)

    curve: list[float] = []
    evaluator = model()
    x, y = data.bundle.val.fetch(torch.arange(len(data.bundle.val)))

    def central_eval(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        evaluator.load_state_dict(arrays.to_torch_state_dict())
        with torch.no_grad():
            acc = int((evaluator(x).argmax(-1) == y).sum()) / len(y)
        if server_round > 0:
            curve.append(acc)
        return MetricRecord({"accuracy": acc})

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=args.clients,
                          min_available_nodes=args.clients)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(model().state_dict()), num_rounds=args.rounds,
                       evaluate_fn=central_eval)

    t0 = time.perf_counter()
    run_simulation(server_app, client_app, num_supernodes=args.clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": args.workers, "include_dashboard": False}})
    wall = time.perf_counter() - t0
    hit = next((i + 1 for i, a in enumerate(curve) if a >= 0.9), None)
    return {"rounds_to_90": hit, "final_accuracy": curve[-1] if curve else None, "wall_s": wall, "curve": curve}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--workers", type=int, default=2, help="CPUs Flower's Ray backend may use")
    p.add_argument("--plait-python", default=str(ROOT / ".venv" / "bin" / "python"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plait = plait_side(args, Path(tmp) / "plait")
    flower = flower_side(args)
    print(f"\nFedAvg, MLP on digits, {args.clients} clients, Dirichlet(0.5), {args.rounds} rounds, seed {args.seed}")
    print(f"{'':>8} {'rounds to 90 %':>15} {'final acc':>10} {'wall s':>8}")
    for name, r in (("flower", flower), ("plait", plait)):
        print(f"{name:>8} {str(r['rounds_to_90']):>15} {r['final_accuracy']:>10.4f} {r['wall_s']:>8.1f}")
    print(f"plait wall time / flower wall time: {plait['wall_s'] / flower['wall_s']:.2f} "
          f"(plait's rounds alone, without process start-up: {plait['rounds_s']:.1f} s)")
    same = max(abs(a - b) for a, b in zip(plait["curve"], flower["curve"])) if flower["curve"] else float("nan")
    print(f"largest per-round accuracy difference between the two: {same:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
