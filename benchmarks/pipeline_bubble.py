"""Pipeline bubble, measured against theory: p = 2 stages, m = 2, 4, 8 micro-batches, GPipe vs 1F1B.

Each run trains the default GPT for a few steps with pp = 2 (2 gloo ranks, one thread each) and
reads its summary: the measured bubble (idle share of each stage's step, from the recorded
forward/backward times) next to (p - 1) / (m + p - 1), and the peak number of micro-batches
whose activations a stage holds at once (GPipe: all m; 1F1B: at most p) with their bytes.

    python benchmarks/pipeline_bubble.py [--steps 6] [--out runs/bench-bubble]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from plait.config import load_config
from plait.testing import RankPool


def run(schedule: str, m: int, steps: int, run_dir: str):
    import torch.distributed as dist

    from plait.train.trainer import train

    cfg = load_config(None, ["parallel.dp=1", "parallel.pp=2", f"parallel.pp_schedule='{schedule}'",
                             f"parallel.microbatches={m}", "train.global_batch_size=32", "train.micro_batch_size=4",
                             f"train.steps={steps}", "log.progress=false", "log.report=false", "train.sample_tokens=0",
                             "train.eval_samples=16", "checkpoint.every=0"])
    s = train(cfg, run_dir).summary
    return (s["pipeline"], s["memory"]["per_rank"]) if dist.get_rank() == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-bubble"))
    a = ap.parse_args()
    rows = []
    with RankPool(2, timeout_s=600) as pool:
        for schedule in ("gpipe", "1f1b"):
            for m in (2, 4, 8):
                pipe, mem = pool.run(run, schedule, m, a.steps, str(a.out / f"{schedule}-m{m}"))[0]
                per_mb = [r["activations_peak_bytes"] for r in mem]
                rows.append({"schedule": schedule, "m": m, **pipe,
                             "inflight_bytes": [n * b for n, b in zip(pipe["peak_inflight_per_rank"], per_mb)]})
    print(f"\n{'schedule':10}{'m':>3}{'bubble measured':>17}{'theory':>8}{'in flight (stage 0, 1)':>24}"
          f"{'activation MiB (stage 0, 1)':>30}")
    for r in rows:
        inflight = ", ".join(map(str, r["peak_inflight_per_rank"]))
        mib = ", ".join(f"{b / 2**20:.1f}" for b in r["inflight_bytes"])
        print(f"{r['schedule']:10}{r['m']:>3}{r['bubble_fraction']:>17.3f}{r['bubble_fraction_theory']:>8.3f}"
              f"{inflight:>24}{mib:>30}")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bubble.json").write_text(json.dumps(rows, indent=1))
    print(f"timelines: {a.out}/<schedule>-m<m>/pipeline.png")


if __name__ == "__main__":
    main()
