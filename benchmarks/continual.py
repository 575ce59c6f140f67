"""Continual learning on split digits: how much each remedy keeps of the earlier tasks.

    python benchmarks/continual.py [--tasks 5] [--steps-per-task 100] [--seeds 2]

digits' ten classes cut into --tasks tasks of consecutive classes (one shared 10-way head: class-incremental), an
MLP trained on them one after another (`data.stream`), plain, with experience replay (`data.replay`), with EWC
(`train.ewc`) and with both. Per variant: the mean validation accuracy over all tasks at the end, the mean
forgetting of the tasks before the last (best accuracy after it was trained less the last), and task 0's
accuracy at the end; medians over seeds. Each run's summary.json holds the whole table.
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

BIN = Path(sys.executable).parent
VARIANTS = {"sequential (no remedy)": [], "replay 0.1": ["data.replay=0.1"], "replay 0.25": ["data.replay=0.25"],
            "EWC lambda 1000": ["train.ewc=1000"], "EWC lambda 10000": ["train.ewc=10000"],
            "replay 0.25 + EWC 1000": ["data.replay=0.25", "train.ewc=1000"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=5)
    ap.add_argument("--steps-per-task", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=2)
    a = ap.parse_args()
    per = 10 // a.tasks
    stream = "[" + ", ".join("{classes = [" + ", ".join(str(c) for c in range(t * per, (t + 1) * per)) + "]}"
                             for t in range(a.tasks)) + "]"
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in VARIANTS}
    with tempfile.TemporaryDirectory() as d:
        for name, extra in VARIANTS.items():
            for seed in range(1234, 1234 + a.seeds):
                run = Path(d) / f"{len(results[name])}-{abs(hash(name))}"
                sets = ["data.name=digits", "model.name=mlp", f"data.stream={stream}", f"train.seed={seed}",
                        f"train.steps={a.tasks * a.steps_per_task}", "parallel.dp=1", "train.micro_batch_size=32",
                        "train.eval_every=0", "train.eval_samples=512", "log.progress=false", "log.report=false",
                        "checkpoint.every=0", *extra]
                subprocess.run([str(BIN / "plait"), "train", *[x for s in sets for x in ("--set", s)], "--out",
                                str(run)], check=True, capture_output=True)
                c = json.loads((run / "summary.json").read_text())["continual"]
                last = c["rows"][-1]["values"]
                forgot = [f for f in c["forgetting"] if f is not None]
                results[name].append((sum(last) / len(last), sum(forgot) / len(forgot), last[0]))
    print(f"load average {os.getloadavg()[0]:.2f}; mlp on digits in {a.tasks} tasks of {per} classes, "
          f"{a.steps_per_task} steps each (batch 32, AdamW), {a.seeds} seeds (median)")
    print("\n| variant | mean accuracy at the end | mean forgetting | task 0 at the end |\n|---|---:|---:|---:|")
    for name, rows in results.items():
        print(f"| {name} | " + " | ".join(f"{statistics.median(col):.3f}" for col in zip(*rows)) + " |")


if __name__ == "__main__":
    main()
