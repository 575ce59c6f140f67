"""Packed shards against the same data in memory: per-step loss and final weights at dp = 1 and dp = 2, and a dp = 2
run stopped after step 2 and resumed in one process (plain SGD on digits, an MLP; the contract of docs/design.md).

    python benchmarks/packed_vs_memory.py [--steps 4] [--shard-size 32KB]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from plait.config import load_config
from plait.data import build_data
from plait.data.packed import pack, parse_size
from plait.testing import RankPool

MLP = ["model.name='mlp'", "data.name='digits'", "model.width=32", "model.depth=1", "train.global_batch_size=64",
       "train.micro_batch_size=16", "train.sample_tokens=0", "log.progress=false", "log.report=false",
       "train.eval_samples=100", "train.eval_batch_size=50"]
SGD = ["optim.name='sgd'", "optim.lr=0.3", "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0",
       "optim.schedule='constant'", "optim.warmup_steps=0", "log.every=1", "checkpoint.every=2", "parallel.dp=1"]


def params(cfg, run_dir, resume=False):
    """Train here or on a pool rank; rank 0's (or this process's) plain parameters."""
    import torch.distributed as dist

    from plait.train.trainer import train

    p = train(cfg, run_dir, resume=resume).strategy.full_model_state_dict()
    return p if not dist.is_initialized() or dist.get_rank() == 0 else None


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--shard-size", default="32KB")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="packed-vs-memory-"))
    cfg = load_config(None, MLP)
    pack(build_data(cfg.data, cfg.model), tmp / "packed", shard_bytes=parse_size(a.shard_size))
    shards = len(list((tmp / "packed").glob("*/chunk-*.bin")))
    sgd = [*SGD, f"train.steps={a.steps}"]
    packed = [*MLP, *sgd, "data.name='packed'", f"data.path='{tmp / 'packed'}'"]
    ref = params(load_config(None, [*MLP, *sgd]), tmp / "mem")
    runs = {"dp=1": params(load_config(None, packed), tmp / "p1")}
    with RankPool(2, timeout_s=120) as pool:
        runs["dp=2"] = pool.run(params, load_config(None, [*packed, "parallel.dp=2"]), tmp / "p2")[0]
        pool.run(params, load_config(None, [*packed, "parallel.dp=2", f"train.stop_after={a.steps // 2}"]), tmp / "r")
    runs["dp=2 -> resumed at dp=1"] = params(load_config(None, packed), tmp / "r", resume=True)
    ref_loss = losses(tmp / "mem")
    out = {}
    print(f"digits packed into {shards} LitData shards of {a.shard_size}; {a.steps} SGD steps; in memory: losses "
          f"{[round(v, 6) for v in ref_loss]}")
    print(f"{'packed run':<26} {'max |w - w_memory|':>20} {'max rel. loss diff':>20}")
    for (name, p), run in zip(runs.items(), ("p1", "p2", "r")):
        dw = max(float((p[k] - ref[k]).abs().max()) for k in ref)
        dl = max(abs(x - y) / abs(y) for x, y in zip(losses(tmp / run), ref_loss))
        out[name] = {"weights": dw, "loss": dl}
        print(f"{name:<26} {dw:>20.3g} {dl:>20.3g}")
    return out


if __name__ == "__main__":
    main()
