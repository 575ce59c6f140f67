"""Pipeline stages on unequal devices: the parameter-balanced split against parallel.pp_split = "auto".

    python benchmarks/pp_split.py [--steps 30] [--factor 3] [--layers 8]

A GPT (width 256, context 64) trains with pp = 2 on 2 processes; pipeline rank 1 is made `--factor` times slower
with PLAIT_FAULTS="slow:rank=1:factor=F" (its forward/backward sleeps (F - 1) x its compute). The default split
gives each rank half the blocks, so every step waits for the slow half; "auto" times each block on each rank
before training and gives the slow rank fewer. Both runs must end on the same weights (the split never changes
the trajectory). Printed: the blocks per stage, the median step time after the first 5 steps, and the ratio.

Target: auto's median step time <= 0.8 x the parameter split's.
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


def run(out: Path, steps: int, layers: int, factor: float, split: str) -> dict:
    sets = ["model.width=256", "model.heads=4", "model.context=64", f"model.layers={layers}", "parallel.dp=1",
            "parallel.pp=2", f"parallel.pp_split={split}", f"train.steps={steps}", "train.global_batch_size=32",
            "train.micro_batch_size=8", "log.every=1", "log.progress=false", "log.report=false", "optim.name=sgd",
            "optim.momentum=0", "checkpoint.every=0", "train.sample_tokens=0", "train.eval_samples=16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PLAIT_FAULTS": f"slow:rank=1:factor={factor}"}
    r = subprocess.run([sys.executable, "-m", "plait", "train", *[a for s in sets for a in ("--set", s)], "--out", str(out)],
                       env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"run failed:\n{r.stdout}\n{r.stderr}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return {"step": statistics.median(x["step_time_s"] for x in rows if "step_time_s" in x and x["step"] > 5),
            "blocks": summary["pipeline"]["stage_blocks"], "val_loss": summary["val_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = run(Path(tmp) / "params", a.steps, a.layers, a.factor, "[]")
        auto = run(Path(tmp) / "auto", a.steps, a.layers, a.factor, "'auto'")
    print(f"pipeline rank 1 {a.factor:g}x slower, GPT {a.layers} blocks, pp = 2, {a.steps} steps")
    print(f"{'split':12}{'blocks per stage':>22}{'step time (median)':>21}{'val loss':>11}")
    for name, r in (("parameters", base), ("auto", auto)):
        blocks = ", ".join(f"{z - s}" for s, z in r["blocks"])
        print(f"{name:12}{blocks:>22}{r['step'] * 1000:>18.1f} ms{r['val_loss']:>11.4f}")
    ratio = auto["step"] / base["step"]
    same = auto["val_loss"] == base["val_loss"]
    print(f"auto / parameters step time: {ratio:.2f}; val loss {'identical' if same else 'DIFFERS'}")
    print(f"target (<= 0.8, same val loss): {'met' if ratio <= 0.8 and same else 'MISSED'}")


if __name__ == "__main__":
    main()
