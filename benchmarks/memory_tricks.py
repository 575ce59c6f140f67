"""Memory tricks (issue 35 item 3): train.channels_last and train.activation_compression, each against its baseline
measured in the same run.

    .venv/bin/python benchmarks/memory_tricks.py [--steps 60] [--repeats 3]

Every configuration is a `plait train` run in one process (parallel.dp=1) on this machine; the figures come from its
summary.json: steady-state throughput (samples/s or tokens/s, the loop's own figure), the activation bytes the meter
counted on the measured steps, and the final training loss. Prints one table; the ratios are against the first row
of each group (channels-last: the CNN on digits; compression: the default GPT).
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

GROUPS = {
    "channels_last": (["model.name=cnn", "data.name=digits", "model.width=64", "train.global_batch_size=64",
                       "train.micro_batch_size=64"],
                      [("NCHW", []), ("NHWC (train.channels_last)", ["train.channels_last=true"])]),
    "activation_compression": ([], [("fp32 activations", []),
                                    ("bf16", ["train.activation_compression='bf16'"]),
                                    ("int8", ["train.activation_compression='int8'"])]),
}


def run(sets: list[str], steps: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "plait", "train", *[a for s in ["parallel.dp=1", f"train.steps={steps}",
                                                                   "train.eval_every=0", "train.sample_tokens=0",
                                                                   "log.report=false", "checkpoint.every=0", *sets]
                                                      for a in ("--set", s)], "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration; the median throughput is shown")
    a = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| group | configuration | throughput | vs first | activation bytes | vs first | final loss |")
    print("|---|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for group, (base, configs) in GROUPS.items():
            first = None
            for name, sets in configs:
                runs = [run(base + sets, a.steps, Path(tmp) / f"{group}-{name[:4]}-{i}") for i in range(a.repeats)]
                rate_key = "tokens_per_s" if "tokens_per_s" in runs[0] else "samples_per_s"
                rate = statistics.median(r[rate_key] for r in runs)
                act = runs[0]["memory"]["per_rank"][0]["activations_peak_bytes"]
                first = first or (rate, act)
                unit = "tok/s" if rate_key == "tokens_per_s" else "samples/s"
                print(f"| {group} | {name} | {rate:,.0f} {unit} | {rate / first[0]:.2f}x | {act / 2**20:.1f} MiB | "
                      f"{act / first[1]:.2f}x | {runs[0]['final_loss']:.4f} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
