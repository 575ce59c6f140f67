"""PipeDream-2BW against 1F1B with a flush: bubble, throughput, weight versions, and convergence.

Throughput (default): p = 2 pipeline ranks (gloo, one thread each), m = 4 and 8 micro-batches, micro-batches
sized to be compute-bound on a CPU core (the bubble benchmark's: width 384, context 64, 8 sequences). Both
schedules train the same model on the same data from the same weights with plain SGD; the schedules alternate
for --repeats rounds. Printed per run: the median step time after the first step, tokens/s, the measured
bubble (summary.json's pipeline section) next to each schedule's theory, micro-batches in flight per stage, and
the weight-version gap (0 for 1F1B: every update uses the gradient of the weights it updates; 1 for PipeDream-2BW).

    python benchmarks/pipedream.py [--steps 8] [--repeats 2] [--out runs/bench-pipedream]

Convergence (--converge): the default job (GPT on the stdlib's text, AdamW) at dp = 1, pp = 2 for --converge-steps
steps, 1F1B and PipeDream-2BW, final validation loss of each (the one-step-stale gradient against the exact one).

    python benchmarks/pipedream.py --converge [--converge-steps 400] [--lr LR] [--delayed]

--delayed adds one process applying each gradient one step late (PipeDream-2BW's rule without a pipeline): where
pipedream's losses follow it, a gap to 1F1B is the rule's, not the pipeline runtime's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from plait.config import load_config
from plait.testing import RankPool

BIG = ["model.width=384", "model.context=64", "model.heads=4", "model.layers=4", "train.micro_batch_size=8"]
SCHEDULES = ("1f1b", "pipedream")


def throughput(schedule: str, m: int, steps: int, run_dir: str):
    """Pool task: train; rank 0 returns (median step seconds after the first, tokens per step, pipeline summary)."""
    import torch.distributed as dist

    from plait.train.trainer import train

    cfg = load_config(None, ["parallel.dp=1", "parallel.pp=2", f"parallel.pp_schedule='{schedule}'", *BIG,
                             f"parallel.microbatches={m}", f"train.global_batch_size={m * 8}", f"train.steps={steps}",
                             "log.progress=false", "log.report=false", "log.every=1", "train.sample_tokens=0",
                             "train.eval_samples=16", "train.eval_every=0", "checkpoint.every=0", "optim.name='sgd'",
                             "optim.momentum=0", "optim.weight_decay=0"])
    s = train(cfg, run_dir).summary
    if dist.get_rank() != 0:
        return None
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r][1:]
    return statistics.median(times), m * 8 * 64, s["pipeline"]


def converge(schedule: str, steps: int, run_dir: str, more: list[str]):
    """Pool task: the default job at pp = 2; rank 0 returns the final validation loss and the losses logged."""
    import torch.distributed as dist

    from plait.train.trainer import train

    cfg = load_config(None, ["parallel.dp=1", "parallel.pp=2", f"parallel.pp_schedule='{schedule}'",
                             f"train.steps={steps}", "log.progress=false", "log.report=false",
                             "train.sample_tokens=0", "checkpoint.every=0", *more])
    s = train(cfg, run_dir).summary
    return (s["val_loss"], logged_losses(run_dir)) if dist.get_rank() == 0 else None


def delayed(steps: int, run_dir: str, more: list[str]) -> tuple[float, dict]:
    """The same job on one process whose optimizer applies each step's gradient one step late (the previous step's
    gradient swapped in after backward): PipeDream-2BW's update rule with no pipeline, as a reference."""
    from plait.parallel.base import Strategy
    from plait.train.trainer import train

    plain = Strategy.forward_backward

    def late(self, micro_batches):
        loss = plain(self, micro_batches)
        params = list(self.module.parameters())
        now = [p.grad for p in params]
        for p, g in zip(params, getattr(self, "_late", [None] * len(params))):
            p.grad = g
        self._late = now
        return loss

    Strategy.forward_backward = late
    try:
        cfg = load_config(None, ["parallel.dp=1", f"train.steps={steps}", "log.progress=false", "log.report=false",
                                 "train.sample_tokens=0", "checkpoint.every=0", *more])
        s = train(cfg, run_dir).summary
    finally:
        Strategy.forward_backward = plain
    return s["val_loss"], logged_losses(run_dir)


def logged_losses(run_dir: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--converge", action="store_true", help="the default job's validation loss, both schedules")
    ap.add_argument("--converge-steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=0.0, help="--converge: optim.lr (0: the default job's)")
    ap.add_argument("--delayed", action="store_true",
                    help="--converge: also one process applying each gradient a step late (the rule, no pipeline)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-pipedream"))
    a = ap.parse_args()
    with RankPool(2, timeout_s=3600) as pool:
        if a.converge:
            more = [f"optim.lr={a.lr}"] if a.lr else []
            rows = {s: pool.run(converge, s, a.converge_steps, str(a.out / f"converge-{s}"), more)[0] for s in SCHEDULES}
            if a.delayed:
                rows["delayed, 1 process"] = delayed(a.converge_steps, str(a.out / "converge-delayed"), more)
            steps = sorted(rows["1f1b"][1])
            shown = [t for t in steps if t % max(1, len(steps) // 4) == 0 or t == steps[-1]]
            print(f"default job{' at lr ' + str(a.lr) if a.lr else ''}, dp = 1, pp = 2, {a.converge_steps} steps; "
                  f"training loss at steps {shown}, then validation loss")
            for name, (val, losses) in rows.items():
                print(f"  {name:20}" + "".join(f"{losses.get(t, float('nan')):>9.4f}" for t in shown) + f"{val:>10.4f}")
            return
        results: dict[tuple, list] = {}
        for k in range(a.repeats):
            for m in (4, 8):
                order = SCHEDULES if k % 2 == 0 else SCHEDULES[::-1]
                for schedule in order:
                    out = str(a.out / f"{schedule}-m{m}-r{k}")
                    results.setdefault((schedule, m), []).append(pool.run(throughput, schedule, m, a.steps, out)[0])
    print(f"\np = 2, micro-batch {' '.join(BIG)}; medians over {a.repeats} runs x {a.steps - 1} steps")
    print(f"{'schedule':10}{'m':>3}{'step ms':>9}{'tok/s':>8}{'bubble':>8}{'theory':>8}{'in flight':>11}"
          f"{'version gap':>13}")
    rows = []
    for (schedule, m), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        step = statistics.median(r[0] for r in runs)
        tokens, pipe = runs[0][1], runs[-1][2]
        bubble = statistics.median(r[2]["bubble_fraction"] for r in runs)
        gap = pipe.get("weight_version_gap", 0)
        rows.append({"schedule": schedule, "m": m, "step_s": step, "tokens_per_s": tokens / step, "bubble": bubble,
                     "theory": pipe["bubble_fraction_theory"], "inflight": pipe["peak_inflight_per_rank"], "gap": gap})
        print(f"{schedule:10}{m:>3}{step * 1000:>9.1f}{tokens / step:>8.0f}{bubble:>8.3f}"
              f"{pipe['bubble_fraction_theory']:>8.3f}{', '.join(map(str, pipe['peak_inflight_per_rank'])):>11}"
              f"{gap:>13}")
    for m in (4, 8):
        base = next(r for r in rows if r["schedule"] == "1f1b" and r["m"] == m)
        pd = next(r for r in rows if r["schedule"] == "pipedream" and r["m"] == m)
        print(f"m = {m}: PipeDream-2BW throughput / 1F1B = {pd['tokens_per_s'] / base['tokens_per_s']:.3f}; "
              f"bubble {base['bubble']:.3f} -> {pd['bubble']:.3f}")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "pipedream.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
