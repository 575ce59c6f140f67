"""Data parallel on unequal devices: the step time of an equal split against parallel.hetero = "auto".

    python benchmarks/hetero.py [--steps 80] [--factor 3] [--width 512]

Two ranks train the same job (mlp on digits, plain SGD, global batch 256); rank 1 is made `--factor` times slower
with PLAIT_FAULTS="slow:rank=1:factor=F" (after its forward/backward it sleeps (F - 1) x the time it took, so the
slowdown scales with its share, as a slower device's would). With an equal split every step waits for rank 1; with
hetero = "auto" each rank's share follows its measured throughput (re-split every 10 steps), so the step time
should fall towards (F + 1) / (2 F) of the equal split's (the ideal split of a rank 1 F times slower). The final
weights of both runs are compared (the trajectory must not change).

Target: auto's median step time (over the steps after the first re-split) <= 0.8 x the equal split's.
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


def run(out: Path, steps: int, width: int, factor: float, hetero: str) -> dict:
    sets = ["model.name=mlp", "data.name=digits", f"model.width={width}", "parallel.dp=2", f"train.steps={steps}",
            "train.global_batch_size=256", "train.micro_batch_size=64", "log.every=1", "log.progress=false",
            "log.report=false", "optim.name=sgd", "optim.momentum=0", "optim.schedule=constant",
            "optim.warmup_steps=0", "checkpoint.every=0", "parallel.hetero_every=10", f"parallel.hetero={hetero!r}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PLAIT_FAULTS": f"slow:rank=1:factor={factor}"}
    r = subprocess.run([sys.executable, "-m", "plait", "train", *[a for s in sets for a in ("--set", s)],
                        "--out", str(out)], env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"run failed:\n{r.stdout}\n{r.stderr}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [x for x in rows if "step_time_s" in x and x["step"] > 21]  # after the first re-split took effect
    return {"step_time": statistics.median(x["step_time_s"] for x in steps_rows),
            "shares": steps_rows[-1].get("batch_shares", [128, 128]),
            "val_loss": json.loads((out / "summary.json").read_text())["val_loss"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--width", type=int, default=512)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        equal = run(Path(d) / "equal", a.steps, a.width, a.factor, "1,1")
        auto = run(Path(d) / "auto", a.steps, a.width, a.factor, "auto")
    ideal = (a.factor + 1) / (2 * a.factor)
    print(f"rank 1 {a.factor:g}x slower, mlp width {a.width}, global batch 256, {a.steps} steps")
    print(f"{'split':<8} {'step time (median)':>20} {'samples per rank':>18} {'val loss':>10}")
    for name, r in (("equal", equal), ("auto", auto)):
        print(f"{name:<8} {r['step_time'] * 1000:>17.1f} ms {str(r['shares']):>18} {r['val_loss']:>10.4f}")
    ratio = auto["step_time"] / equal["step_time"]
    print(f"auto / equal step time: {ratio:.2f} (ideal {ideal:.2f}); val loss difference "
          f"{abs(auto['val_loss'] - equal['val_loss']):.2e}")
    met = ratio <= 0.8 and abs(auto["val_loss"] - equal["val_loss"]) <= 1e-4
    print("target (<= 0.8, same val loss):", "met" if met else "MISSED")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
