"""A slow rank under AD-PSGD, synchronous gossip and all-reduce: the steps per second of the fast ranks.

    python benchmarks/gossip_async.py [--dp 2] [--steps 200] [--factor 3] [--width 512] [--micro 256] [--repeats 3]

`dp` ranks train the same job (mlp on digits); rank 1 is made `--factor` times slower with
PLAIT_FAULTS="slow:rank=1:factor=F" (after its forward/backward it sleeps (F - 1) x the time it took).
Each rank runs all `--steps` of its own. Baseline: all-reduce (DDP), where every step waits for rank 1.

* all-reduce and synchronous gossip (ring, every step) are in lockstep: every rank's pace is rank 1's.
  Their figure is 1 / the step time of the run's last metrics window (steps 2..N).
* AD-PSGD (`parallel.gossip_async = true`, ring): a rank waits only for an exchange's answer, which a
  passive rank's server thread gives whatever its compute. The figure is each fast rank's own pace,
  steps per second from its second step to its last (summary.json's gossip.steps_per_s_per_rank),
  before it waits at the end for the slow rank to finish its steps.

log.every = steps: plait's logging steps are an all-gather (a global barrier), so with the default
log.every = 10 no rank runs more than 10 steps ahead; the row "AD-PSGD, log.every=10" shows that.
The job's wall time is still the slow rank's (every rank does all its steps); what the fast ranks
gain is updates per second, the paper's claim. Figures are medians over --repeats runs, ratios
against all-reduce measured in the same run of this script. Run it with --dp at most the machine's
cores (the fast ranks' compute must not share a core): the default dp = 2 has one fast rank (0,
active) and the slow one (1, passive); --dp 4 adds a fast active rank (2) and a fast passive one (3).
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

MODES = [
    ("all-reduce", ["parallel.sync=allreduce"], None),
    ("gossip (sync)", ["parallel.sync=gossip"], None),
    ("AD-PSGD", ["parallel.sync=gossip", "parallel.gossip_async=true"], None),
    ("AD-PSGD, log.every=10", ["parallel.sync=gossip", "parallel.gossip_async=true"], 10),
]


def run(out: Path, a, sets: list[str], log_every: int | None) -> dict:
    common = ["model.name=mlp", "data.name=digits", f"model.width={a.width}", f"parallel.dp={a.dp}",
              f"train.steps={a.steps}", f"train.global_batch_size={a.micro * a.dp}", f"train.micro_batch_size={a.micro}",
              f"log.every={log_every or a.steps}", "log.progress=false", "log.report=false", "checkpoint.every=0",
              "train.eval_every=0", "train.eval_samples=512", f"launch.nproc_per_node={a.dp}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PLAIT_FAULTS": f"slow:rank=1:factor={a.factor}"}
    r = subprocess.run([sys.executable, "-m", "plait", "train", *[x for s in common + sets for x in ("--set", s)],
                        "--out", str(out)], env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"run failed:\n{r.stdout}\n{r.stderr}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    last = [x for x in rows if "step_time_s" in x][-1]
    g = summary.get("gossip", {})
    lockstep = 1 / last["step_time_s"]
    per_rank = g.get("steps_per_s_per_rank") if "gossip_async" in " ".join(sets) else None
    fast = [s for i, s in enumerate(per_rank or [lockstep] * a.dp) if i != 1]
    return {"fast": statistics.median(fast), "slow": (per_rank or [lockstep] * a.dp)[1],
            "wall": summary["train_time_s"], "acc": summary["val_accuracy"],
            "staleness": g.get("staleness_mean"), "staleness_max": g.get("staleness_max")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--micro", type=int, default=256, help="samples per rank per step (compute per exchanged byte)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    results: dict[str, list[dict]] = {name: [] for name, _, _ in MODES}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(a.repeats):  # interleaved, so drifting machine load falls on every mode alike
            for i, (name, sets, log_every) in enumerate(MODES):
                results[name].append(run(Path(d) / f"{rep}-{i}", a, sets, log_every))

    def med(name, key):
        vals = [r[key] for r in results[name] if r[key] is not None]
        return statistics.median(vals) if vals else None

    base = med("all-reduce", "fast")
    print(f"rank 1 {a.factor:g}x slower (PLAIT_FAULTS=slow:rank=1:factor={a.factor:g}), dp={a.dp}, mlp width "
          f"{a.width} on digits, {a.micro} samples per rank per step, {a.steps} steps per rank, median of {a.repeats}")
    print(f"{'scheme':<24}{'fast ranks steps/s':>20}{'vs all-reduce':>15}{'slow rank steps/s':>19}"
          f"{'job train s':>13}{'val acc':>9}{'staleness mean/max':>20}")
    for name, _, _ in MODES:
        st = med(name, "staleness")
        stale = f"{st:.1f} / {med(name, 'staleness_max'):.0f}" if st is not None else "-"
        print(f"{name:<24}{med(name, 'fast'):>20.1f}{med(name, 'fast') / base:>14.2f}x{med(name, 'slow'):>19.1f}"
              f"{med(name, 'wall'):>13.2f}{med(name, 'acc'):>9.3f}{stale:>20}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
