"""Curriculum learning against uniform sampling: steps and time to a validation target (issue 36 item 3).

    .venv/bin/python benchmarks/curriculum.py [--seeds 3] [--target 0.9]

The MLP on digits in one process, AdamW at the default schedule, evaluated every 5 steps with train.target =
{metric = "val_accuracy", value = --target}. A reference run (50 steps, seed 0) scores every training sample by
its loss; each curriculum run draws from the easiest `start` of them first (data.curriculum, score = "loss",
pacing linear and root). Each configuration runs once per seed; the table gives the median steps and seconds to
the target and how many seeds reached it in --steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = ["model.name=mlp", "data.name=digits", "model.width=32", "parallel.dp=1", "train.global_batch_size=32",
        "train.micro_batch_size=32", "train.eval_every=5", "train.eval_samples=256", "checkpoint.every=0",
        "log.report=false"]


def train(sets: list[str], out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "plait", "train", *[a for s in sets for a in ("--set", s)], "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--start", type=float, default=0.2)
    a = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        ref = Path(tmp) / "ref"
        train([*BASE, "train.steps=50", "train.seed=0"], ref)
        configs = {"uniform (shuffle)": [],
                   **{f"curriculum, loss, {p}": [f"data.curriculum={{score='loss', model='{ref}', pacing='{p}', "
                                                 f"start={a.start}, full_at=0.5}}"] for p in ("linear", "root")}}
        print(f"| sampling | seeds reaching val_accuracy >= {a.target:g} | median steps | median seconds |")
        print("|---|---:|---:|---:|")
        for c, (name, more) in enumerate(configs.items()):
            hits = []
            for seed in range(1, a.seeds + 1):
                s = train([*BASE, *more, f"train.steps={a.steps}", f"train.seed={seed}",
                           f"train.target={{metric='val_accuracy', value={a.target}}}"], Path(tmp) / f"{c}-{seed}")
                t = s["time_to_target"]
                if t["reached"]:
                    hits.append((t["step"], t["wall_time_s"]))
            med = (f"{statistics.median(h[0] for h in hits):.0f} | {statistics.median(h[1] for h in hits):.2f}"
                   if hits else "- | -")
            print(f"| {name} | {len(hits)} of {a.seeds} | {med} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
