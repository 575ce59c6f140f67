"""plait's training step against a hand-written raw-torch loop: DDP, or FSDP2 for ZeRO-3.

    --scheme ddp   plait (zero=0) vs a plain DDP loop            (target <= 1.05)
    --scheme fsdp  plait (zero=3) vs a plain FSDP2 fully_shard loop (target <= 1.05)
    --model gpt    the default GPT (0.82 M parameters) on stdlib-text, global batch 32
    --model mlp    a 0.4 M-parameter MLP (width 600, 2 hidden layers) on digits, global batch 64, one
                   micro-batch per rank: ~6 ms steps, where a per-step tax of plait's shows

Same model, data, global batch, optimizer and clipping, same gloo ranks (plait.testing's
harness, one thread per rank). The two alternate `--repeats` times in one run. plait runs
with its default logging (a metrics record every log.every = 10 steps, each the mean step time
of its window, logging included); the raw loop's steps are timed one by one and averaged over
the same windows of 10. The medians of the window means are compared, which a noisy shared
machine disturbs least. Target: plait / raw <= 1.05.

    python benchmarks/overhead.py [--model gpt|mlp] [--scheme ddp|fsdp] [--steps 200] [--warmup 10] [--repeats 4]
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

from plait.config import load_config
from plait.testing import RankPool

WINDOW = 10  # plait's default log.every: its step times are means over windows of this many steps
MODELS = {
    "gpt": (),
    "mlp": ("model.name=mlp", "data.name=digits", "model.width=600", "model.depth=2", "train.global_batch_size=64",
            "train.micro_batch_size=32"),
}


def config(model: str, world: int, steps: int, extra: tuple = ()):
    return load_config(None, [*MODELS[model], *extra,
        f"parallel.dp={world}", f"train.steps={steps}", f"log.every={WINDOW}", "log.progress=false",
        "log.report=false", "train.sample_tokens=0", "train.eval_samples=16", "checkpoint.every=0",
    ])


def raw_loop(model_name: str, world: int, steps: int, warmup: int, scheme: str = "ddp") -> list[float]:
    """Seconds of each step of a plain DDP (or FSDP2) loop after `warmup`."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from plait.data import build_data
    from plait.models import build_model
    from plait.train.loss import loss_for

    cfg = config(model_name, world, warmup + steps)
    t = cfg.train
    bundle = build_data(cfg.data, cfg.model)
    data = bundle.train
    loss_fn = loss_for(bundle.spec)
    torch.manual_seed(t.seed)
    model = build_model(cfg.model, bundle.spec)
    if scheme == "ddp":
        ddp = DDP(model, gradient_as_bucket_view=True)  # the same DDP options plait uses: this measures the loop
    else:
        from torch.distributed.fsdp import fully_shard

        from plait.parallel.base import model_blocks

        for block in model_blocks(model):
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
                loss = loss_fn(ddp(x), y) / accum
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def windows(times: list[float]) -> list[float]:
    """Mean step time over consecutive windows of WINDOW steps."""
    return [statistics.mean(times[i:i + WINDOW]) for i in range(0, len(times) - WINDOW + 1, WINDOW)]


def plait_loop(model: str, world: int, steps: int, warmup: int, run_dir: str, extra: tuple = ()) -> list[float] | None:
    """Mean step time of each full logging window of plait's trainer after `warmup`, from its own metrics."""
    from plait.train.trainer import train

    train(config(model, world, warmup + steps, extra), run_dir)
    if dist.get_rank() != 0:
        return None
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > warmup + WINDOW - 1
            and r["step"] % WINDOW == 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=tuple(MODELS), default="gpt")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per measurement (a multiple of 10)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (a multiple of 10)")
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
                    got = windows(pool.run(raw_loop, a.model, a.world, a.steps, a.warmup, a.scheme)[0])
                    raw += got
                else:
                    extra = (*a.set, f"parallel.zero={0 if a.scheme == 'ddp' else 3}")
                    got = pool.run(plait_loop, a.model, a.world, a.steps, a.warmup, f"{tmp}/run{i}", extra)[0]
                    ours += got
                print(f"repeat {i + 1} {who:5}: median {statistics.median(got) * 1000:.1f} ms/step", flush=True)
    r, p = statistics.median(raw), statistics.median(ours)
    name = "DDP" if a.scheme == "ddp" else "FSDP2 (fully_shard per block + root)"
    what = "default GPT, global batch 32" if a.model == "gpt" else "0.4 M-parameter MLP on digits, global batch 64"
    print(f"\nbaseline: hand-written torch {name} loop, {a.world} gloo ranks, {what}, "
          f"{len(raw)} windows of {WINDOW} steps each")
    print(f"{'':14}{'median ms/step':>16}{'mean ms/step':>14}")
    print(f"{'raw ' + a.scheme:14}{r * 1000:>16.1f}{statistics.mean(raw) * 1000:>14.1f}")
    print(f"{'plait zero=' + ('0' if a.scheme == 'ddp' else '3'):14}{p * 1000:>16.1f}{statistics.mean(ours) * 1000:>14.1f}")
    print(f"ratio plait / raw = {p / r:.3f}  (median; target <= 1.05)")


if __name__ == "__main__":
    main()
