"""Scheduling policies on a 1,000-job synthetic trace against FIFO, next to what the papers report.

    python benchmarks/cluster_policies.py [--jobs 1000] [--devices 64] [--load 0.9] [--seeds 3]

Each seed draws its own trace (plait.cluster.trace.synthetic: Poisson arrivals at the given offered load, heavy-
tailed lengths, 1-32-device jobs) and every policy replays it (plait.cluster.sim). The table gives each policy's
average JCT, makespan and utilisation with FIFO's average JCT over the policy's (median over seeds, and the range).
The papers' figures come from their own traces and clusters; ours are the same ratios on a synthetic trace.

Targets (checked at the end): tiresias and gandiva improve FIFO's average JCT by >= 2x; srtf, which knows every
job's length, is the best of all in average JCT; no policy's makespan exceeds FIFO's by more than 10 %.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from plait.cluster.cli import PAPERS
from plait.cluster.policies import POLICIES
from plait.cluster.sim import simulate
from plait.cluster.trace import synthetic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--load", type=float, default=0.9)
    ap.add_argument("--seeds", type=int, default=3)
    a = ap.parse_args()
    rows: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for seed in range(a.seeds):
        trace = synthetic(a.jobs, a.devices, seed, a.load)
        base = simulate(trace, a.devices, "fifo").summary()
        for p in POLICIES:
            s = base if p == "fifo" else simulate(trace, a.devices, p).summary()
            s["speedup"] = base["avg_jct_s"] / s["avg_jct_s"]
            s["makespan_ratio"] = s["makespan_s"] / base["makespan_s"]
            rows[p].append(s)
    print(f"{a.jobs} jobs, {a.devices} devices, offered load {a.load}, {a.seeds} seeds (median [min-max])")
    head = f"{'policy':<9} {'avg JCT h':>10} {'FIFO/it avg JCT':>20} {'makespan/FIFO':>14} {'util.':>6}  paper"
    print(head)
    print("-" * len(head))
    med = {}
    for p, rs in rows.items():
        sp = [r["speedup"] for r in rs]
        med[p] = {"speedup": statistics.median(sp),
                  "makespan": max(r["makespan_ratio"] for r in rs)}
        print(f"{p:<9} {statistics.median(r['avg_jct_s'] for r in rs) / 3600:>10.2f} "
              f"{med[p]['speedup']:>7.2f}x [{min(sp):.2f}-{max(sp):.2f}] "
              f"{statistics.median(r['makespan_ratio'] for r in rs):>14.2f} "
              f"{statistics.median(r['utilisation'] for r in rs) * 100:>5.1f}%  {PAPERS[p]}")
    misses = []
    for p in ("tiresias", "gandiva"):
        if med[p]["speedup"] < 2:
            misses.append(f"{p}: FIFO/it average JCT {med[p]['speedup']:.2f} < 2")
    if max(med, key=lambda p: med[p]["speedup"]) != "srtf":
        misses.append("srtf is not the best in average JCT")
    misses += [f"{p}: makespan {med[p]['makespan']:.2f}x FIFO's" for p in med if med[p]["makespan"] > 1.1]
    print("targets:", "met" if not misses else "MISSED: " + "; ".join(misses))
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
