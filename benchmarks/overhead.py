"""plait's training step against a hand-written raw-torch loop: DDP, or FSDP2 for ZeRO-3.

    --scheme ddp   plait (zero=0) vs a plain DDP loop            (foundation issue; target <= 1.05)
    --scheme fsdp  plait (zero=3) vs a plain FSDP2 fully_shard loop (ZeRO issue; target <= 1.05)

Same model (the default GPT), same data (stdlib-text windows), same global batch,
same optimizer and clipping, same 2 gloo ranks (plait.testing's harness, one
thread per rank). The two alternate `--repeats` times in one run; every step is
timed (plait by its own metrics, logged every step) and the medians of the
per-step times are compared, which a noisy shared machine disturbs least.
Target: plait / raw <= 1.05.

    python benchmarks/overhead.py [--scheme ddp|fsdp] [--steps 40] [--warmup 5] [--repeats 4] [--world 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.config import load_config
from plait.testing import RankPool


def config(world: int, steps: int, log_every: int, extra: tuple = ()):
    return load_config(None, [*extra,
        f"parallel.dp={world}", f"train.steps={steps}", f"log.every={log_every}", "log.progress=false",
        "log.report=false", "train.sample_tokens=0", "train.eval_samples=16", "checkpoint.every=0",
    ])


def raw_loop(world: int, steps: int, warmup: int, scheme: str = "ddp") -> list[float]:
    """Seconds of each step of a plain DDP (or FSDP2) loop after `warmup`."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from plait.data import build_data
    from plait.models.gpt import GPT

    cfg = config(world, warmup + steps, 10)
    m, t = cfg.model, cfg.train
    data = build_data(cfg.data, cfg.model).train
    torch.manual_seed(t.seed)
    model = GPT(data_vocab(cfg), m.context, m.width, m.heads, m.layers, m.tie_embeddings)
    if scheme == "ddp":
        ddp = DDP(model, gradient_as_bucket_view=True)  # the same DDP options plait uses: this measures the loop
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks.values():
            fully_shard(block)
        ddp = fully_shard(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optim.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.optim.lr, betas=tuple(cfg.optim.betas))
    local = t.global_batch_size // world
    gen = torch.Generator().manual_seed(dist.get_rank())
    accum = local // t.micro_batch_size
    times = []
    for step in range(warmup + steps):
        if step == warmup:
            dist.barrier()
        t0 = time.perf_counter()
        for i in range(accum):
            x, y = data.fetch(torch.randint(0, len(data), (t.micro_batch_size,), generator=gen))
            if scheme == "ddp":
                ctx = ddp.no_sync() if i < accum - 1 else torch.enable_grad()
            else:
                ddp.set_requires_gradient_sync(i == accum - 1)
                ctx = torch.enable_grad()
            with ctx:
                loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()) / accum
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the raw loop looks at its loss every step, as plait does when logging every step
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def data_vocab(cfg) -> int:
    from plait.data import build_data

    return build_data(cfg.data, cfg.model).spec.vocab_size


def plait_ddp(world: int, steps: int, warmup: int, run_dir: str, extra: tuple = ()) -> list[float] | None:
    """Seconds of each step of plait's trainer after `warmup`, from its own metrics (logged every step)."""
    from plait.train.trainer import train

    train(config(world, warmup + steps, 1, extra), run_dir)
    if dist.get_rank() != 0:
        return None
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > warmup]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="timed steps per measurement")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--scheme", choices=("ddp", "fsdp"), default="ddp", help="baseline: DDP (zero=0) or FSDP2 (zero=3)")
    ap.add_argument("--set", action="append", default=[], help="extra plait config overrides")
    a = ap.parse_args()
    raw: list[float] = []
    ours: list[float] = []
    with RankPool(a.world, timeout_s=600) as pool, tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            order = ["raw", "plait"] if i % 2 == 0 else ["plait", "raw"]  # neither always runs first
            for who in order:
                if who == "raw":
                    got = pool.run(raw_loop, a.world, a.steps, a.warmup, a.scheme)[0]
                    raw += got
                else:
                    extra = (*a.set, f"parallel.zero={0 if a.scheme == 'ddp' else 3}")
                    got = pool.run(plait_ddp, a.world, a.steps, a.warmup, f"{tmp}/run{i}", extra)[0]
                    ours += got
                print(f"repeat {i + 1} {who:5}: median {statistics.median(got) * 1000:.1f} ms/step", flush=True)
    r, p = statistics.median(raw), statistics.median(ours)
    name = "DDP" if a.scheme == "ddp" else "FSDP2 (fully_shard per block + root)"
    print(f"\nbaseline: hand-written torch {name} loop, {a.world} gloo ranks, default GPT, global batch 32, "
          f"{len(raw)} steps each")
    print(f"{'':14}{'median ms/step':>16}{'mean ms/step':>14}")
    print(f"{'raw ' + a.scheme:14}{r * 1000:>16.1f}{statistics.mean(raw) * 1000:>14.1f}")
    print(f"{'plait zero=' + ('0' if a.scheme == 'ddp' else '3'):14}{p * 1000:>16.1f}{statistics.mean(ours) * 1000:>14.1f}")
    print(f"ratio plait / raw = {p / r:.3f}  (median; target <= 1.05)")


if __name__ == "__main__":
    main()
