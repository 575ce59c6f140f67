"""`plait whatif` against the truth: each change predicted from one profiled run, then run for real.

    python benchmarks/whatif.py [--steps 40] [--repeats 2] [--set KEY=VALUE ...]

The base job (the default GPT on stdlib-text, 2 ranks, DDP, 2 blocks; --set adds keys) trains with
log.profile_steps covering 5 steps; `plait whatif` predicts each change's step time from those traces (the
base run's median step time times the simulated ratio). Then the changed job runs (the same keys plus the change's
own) and its median step time over the steps after the first 10 is the truth. Error = predicted / actual - 1.
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
# change -> the keys that make it real
REAL = {"compression=fp16": ["parallel.compression=fp16"], "zero=1": ["parallel.zero=1"],
        "fuse_optimizer": ["optim.fused=true"], "checkpointing": ["train.activation_checkpointing=true"]}


def median_step(run: Path, skip: int = 10) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows if "step_time_s" in r and r.get("step", 0) > skip)


def train(run: Path, sets: list[str]) -> None:
    subprocess.run([str(BIN / "plait"), "train", *[x for s in sets for x in ("--set", s)], "--out", str(run)],
                   check=True, capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args()
    from plait.plan.whatif import predict

    base = ["parallel.dp=2", "model.layers=2", f"train.steps={a.steps}", "train.eval_every=0", "train.sample_tokens=0",
            "checkpoint.every=0", "log.every=1", "log.progress=false", "log.report=false", *a.set]
    first = a.steps // 2
    measured: dict[str, list[float]] = {"base": [], **{c: [] for c in REAL}}
    predicted: dict[str, list[float]] = {c: [] for c in REAL}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.repeats):
            run = Path(d) / f"base{r}"
            train(run, [*base, f"log.profile_steps=[{first}, {first + 4}]"])
            t = median_step(run)
            measured["base"].append(t)
            got = predict(run, list(REAL))
            for c in REAL:
                predicted[c].append(t * got["changes"][c]["ratio"])
            for c, keys in REAL.items():
                changed = Path(d) / f"{c}{r}"
                train(changed, [*base, *keys])
                measured[c].append(median_step(changed))
    print(f"load average {os.getloadavg()[0]:.2f}; default GPT with 2 blocks on stdlib-text, dp 2 (gloo, CPU), "
          f"{a.steps} steps, medians over {a.repeats} repeats; base step {statistics.median(measured['base']) * 1e3:.1f} ms")
    print("\n| change | predicted ms | actual ms | error |\n|---|---:|---:|---:|")
    for c in REAL:
        p, m = statistics.median(predicted[c]), statistics.median(measured[c])
        print(f"| {c} | {p * 1e3:.1f} | {m * 1e3:.1f} | {100 * (p / m - 1):+.1f} % |")


if __name__ == "__main__":
    main()
