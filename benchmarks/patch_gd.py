"""Patch gradient descent against whole-image training at the same steps, on large-digits.

    python benchmarks/patch_gd.py [--canvas 32] [--scale 2] [--patch 16] [--steps 1500] [--grad 1,2]

Rows (each a `plait train` of the CNN, 3 blocks of width 32, AdamW at 3e-3, the same data, batch, steps and seed; the
tiny CNN needs ~1500 steps to read a digit placed at random, 300 leave every row at chance):

    whole image           model.patch_size = 0: the CNN's blocks over the whole canvas
    patches, all grad     model.patch_size = P, model.patch_grad = 0: the patch model back-propagating every patch
    PatchGD k             model.patch_size = P, model.patch_grad = k: k patches back-propagated per step

Columns: validation accuracy and loss at the end, the activations' peak bytes per step (plait's accounting,
summary.json memory.per_rank), and the median step time.
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


def run(name: str, sets: list[str], out: Path) -> dict:
    cmd = [str(BIN / "plait"), "train", *[a for s in sets for a in ("--set", s)], "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "GLOO_SOCKET_IFNAME": "lo"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{name} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    times = [json.loads(line).get("step_time_s") for line in (out / "metrics.jsonl").open()]
    times = [t for t in times if t]
    return {"name": name, "val_accuracy": s["val_accuracy"], "val_loss": s["val_loss"],
            "activations": s["memory"]["per_rank"][0]["activations_peak_bytes"],
            "step_s": statistics.median(times[1:] or times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--canvas", type=int, default=32)
    ap.add_argument("--scale", type=int, default=2)
    ap.add_argument("--patch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--grad", default="1,2")
    ap.add_argument("--width", type=int, default=32)
    a = ap.parse_args()
    base = ["model.name=cnn", "data.name=large-digits", f"data.canvas_size={a.canvas}", f"data.digit_scale={a.scale}",
            f"model.width={a.width}", "model.depth=3", "parallel.dp=1", f"train.steps={a.steps}",
            "train.global_batch_size=32", "train.micro_batch_size=32", "train.eval_samples=512", "log.every=10",
            "log.progress=false", "log.report=false", "optim.name=adamw", "optim.lr=3e-3",
            "checkpoint.every=0"]
    rows_cfg = [("whole image", []), ("patches, all grad", [f"model.patch_size={a.patch}"])]
    rows_cfg += [(f"PatchGD k={k}", [f"model.patch_size={a.patch}", f"model.patch_grad={k}"])
                 for k in map(int, a.grad.split(","))]
    n = (a.canvas // a.patch) ** 2
    print(f"load average {os.getloadavg()[0]:.2f}; large-digits {a.canvas} x {a.canvas} ({8 * a.scale}-pixel digits), "
          f"patches {a.patch} x {a.patch} ({n} an image), {a.steps} steps of 32")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for i, (name, sets) in enumerate(rows_cfg):
            rows.append(run(name, base + sets, Path(d) / str(i)))
            print(f"  {name}: done", flush=True)
    print("\n| training | val accuracy | val loss | activation peak MiB / step | step time ms |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['val_accuracy']:.3f} | {r['val_loss']:.3f} | {r['activations'] / 2**20:.1f} | "
              f"{1000 * r['step_s']:.0f} |")
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
