"""plait's training step against a hand-written raw-torch loop: DDP, or FSDP2 for ZeRO-3.

    --scheme ddp   plait (zero=0) vs a plain DDP loop            (target <= 1.05)
    --scheme fsdp  plait (zero=3) vs a plain FSDP2 fully_shard loop (target <= 1.05)
    --model gpt    the default GPT (0.82 M parameters) on stdlib-text, global batch 32
    --model mlp    a 0.4 M-parameter MLP (width 600, 2 hidden layers) on digits, global batch 64, one
                   micro-batch per rank: ~6 ms steps, where a per-step tax of plait's shows

Both sides do the same work: the same initial weights, batches (plait's seeded sampler), optimizer, learning-rate
schedule and clipping, on the same gloo ranks (plait.testing's harness, one thread per rank); their losses agree step
for step (printed, and asserted in tests/test_benchmarks.py). A raw loop that kept its peak learning rate throughout
drifted into denormal floats and slowed by a third, which once made plait look 35 % faster than it.
The two alternate `--repeats` times in one run. plait runs
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


def config(model: str, world: int, steps: int, extra: tuple = (), every: int = WINDOW):
    return load_config(None, [*MODELS[model], *extra,
        f"parallel.dp={world}", f"train.steps={steps}", f"log.every={every}", "log.progress=false",
        "log.report=false", "train.sample_tokens=0", "train.eval_samples=16", "checkpoint.every=0",
    ])


def raw_loop(model_name: str, world: int, steps: int, warmup: int, scheme: str = "ddp",
             every: int = WINDOW) -> tuple[list[float], list[float], list[float]]:
    """A plain DDP (or FSDP2) loop doing plait's work: the same initial weights, batches (plait's seeded global-batch
    sampler, each rank its slice), optimizer and parameter groups, learning-rate schedule and clipping. Returns the
    seconds of each step after `warmup`, and every step's loss (the global batch's mean) and gradient norm, gathered
    once after the loop so the timed steps hold no extra sync."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from plait.data import build_data
    from plait.data.sampler import make_sampler, micro_batches, shard
    from plait.models import build_model
    from plait.runtime import seed_all
    from plait.train.loss import loss_for
    from plait.train.optim import build_optimizer, lr_at, set_lr

    cfg = config(model_name, world, warmup + steps, every=every)
    t = cfg.train
    bundle = build_data(cfg.data, cfg.model)
    data = bundle.train
    loss_fn = loss_for(bundle.spec)
    seed_all(t.seed)
    model = build_model(cfg.model, bundle.spec)
    if scheme == "ddp":
        ddp = DDP(model, gradient_as_bucket_view=True)  # the same DDP options plait uses: this measures the loop
    else:
        from torch.distributed.fsdp import fully_shard

        from plait.parallel.base import model_blocks

        for block in model_blocks(model):
            fully_shard(block)
        ddp = fully_shard(model)
    opt = build_optimizer(model, cfg.optim)
    sampler = make_sampler(data, t.global_batch_size, t.seed, cfg.data.sampler)
    rank = dist.get_rank()
    accum = t.global_batch_size // world // t.micro_batch_size
    times, losses, norms = [], [], []
    for step in range(warmup + steps):
        if step == warmup:
            dist.barrier()
        t0 = time.perf_counter()
        set_lr(opt, lr_at(step, cfg.optim, warmup + steps, t.global_batch_size))
        total = torch.zeros(())
        for i, idx in enumerate(micro_batches(shard(sampler.global_batch(step), rank, world), t.micro_batch_size)):
            x, y = data.fetch(idx)
            if scheme == "ddp":
                ctx = ddp.no_sync() if i < accum - 1 else torch.enable_grad()
            else:
                ddp.set_requires_gradient_sync(i == accum - 1)
                ctx = torch.enable_grad()
            with ctx:
                loss = loss_fn(ddp(x), y) / accum
                loss.backward()
            total += loss.detach()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip).detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    gathered = torch.stack(losses)
    dist.all_reduce(gathered)  # once, after the timed steps
    norms_t = torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms])
    return times, (gathered / world).tolist(), norms_t.tolist()


def windows(values: list[float], every: int = WINDOW) -> list[float]:
    """Means over consecutive windows of `every` steps."""
    return [statistics.mean(values[i:i + every]) for i in range(0, len(values) - every + 1, every)]


def plait_loop(model: str, world: int, steps: int, warmup: int, run_dir: str, extra: tuple = (),
               every: int = WINDOW) -> tuple[list[float], list[dict]] | None:
    """Mean step time of each full logging window of plait's trainer after `warmup`, from its own metrics; and every
    logged record (step, loss: the window's mean, grad_norm: its last step's)."""
    from plait.train.trainer import train

    train(config(model, world, warmup + steps, extra, every), run_dir)
    if dist.get_rank() != 0:
        return None
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r and "step" in r]
    return [r["step_time_s"] for r in logged if r["step"] > warmup + every - 1 and r["step"] % every == 0], logged


def agreement(raw_losses: list[float], logged: list[dict], every: int = WINDOW) -> float:
    """The largest difference between plait's logged losses (each the mean over the steps since the record before:
    step 1 is logged alone) and the raw loop's over the same steps."""
    diffs, prev = [], 0
    for r in logged:
        diffs.append(abs(r["loss"] - statistics.mean(raw_losses[prev:r["step"]])))
        prev = r["step"]
    return max(diffs)


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
    worst = 0.0
    with RankPool(a.world, timeout_s=600) as pool, tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            order = ["raw", "plait"] if i % 2 == 0 else ["plait", "raw"]  # neither always runs first
            for who in order:
                if who == "raw":
                    times, raw_losses, _ = pool.run(raw_loop, a.model, a.world, a.steps, a.warmup, a.scheme)[0]
                    got = windows(times)
                    raw += got
                else:
                    extra = (*a.set, f"parallel.zero={0 if a.scheme == 'ddp' else 3}")
                    got, logged = pool.run(plait_loop, a.model, a.world, a.steps, a.warmup, f"{tmp}/run{i}", extra)[0]
                    ours += got
                print(f"repeat {i + 1} {who:5}: median {statistics.median(got) * 1000:.1f} ms/step", flush=True)
            worst = max(worst, agreement(raw_losses, logged))
    r, p = statistics.median(raw), statistics.median(ours)
    name = "DDP" if a.scheme == "ddp" else "FSDP2 (fully_shard per block + root)"
    what = "default GPT, global batch 32" if a.model == "gpt" else "0.4 M-parameter MLP on digits, global batch 64"
    print(f"\nbaseline: hand-written torch {name} loop, {a.world} gloo ranks, {what}, "
          f"{len(raw)} windows of {WINDOW} steps each")
    print(f"{'':14}{'median ms/step':>16}{'mean ms/step':>14}")
    print(f"{'raw ' + a.scheme:14}{r * 1000:>16.1f}{statistics.mean(raw) * 1000:>14.1f}")
    print(f"{'plait zero=' + ('0' if a.scheme == 'ddp' else '3'):14}{p * 1000:>16.1f}{statistics.mean(ours) * 1000:>14.1f}")
    print(f"ratio plait / raw = {p / r:.3f}  (median; target <= 1.05)")
    print(f"same work: the window losses of the two sides differ by at most {worst:.2e}")


if __name__ == "__main__":
    main()
