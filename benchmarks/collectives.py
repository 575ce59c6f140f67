"""plait's own all-reduce against gloo's: ring and recursive halving-doubling ("tree") next to dist.all_reduce.

For 2 and 4 local gloo ranks and 1 MB to 64 MB, `plait bench collectives`' sweep (plait.comm.bench): a
warm-up, then `--repeats` trials in which native, ring and tree take turns, so that a burst of load on a
shared machine hits all three alike. A trial's time is the slowest rank's mean over `--iters` calls; the
ratio printed is the median over the repeats of native's time over the algorithm's in the same repeat
(busbw ratio; > 1: faster than gloo's own), with the median busbw and its min-max over the repeats.
Beside it, per call on rank 0: the median call (algorithm, then native) and the share of calls that
stalled (took over 3x the median: on a machine with fewer cores than busy threads, a thread waiting for
a core). A trial's mean is set by how many of its calls stall.

Target (issue: plait's own all-reduce against gloo's): ratio >= 0.9 at every size from 1 MB to 64 MB
on 2 and 4 ranks, so that `parallel.allreduce = "ring"` is not a slowdown.

    python benchmarks/collectives.py [--ranks 2,4] [--sizes 1M,4M,16M,64M] [--repeats 9] [--iters 10] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from plait.comm.bench import BenchOptions, bench_rank, format_table, human, parse_sizes, plot, write_csv
from plait.testing import RankPool

TARGET = 0.9
ALGOS = ["native", "ring", "tree"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    ap.add_argument("--sizes", default="1M,4M,16M,64M", help="as `plait bench collectives --sizes`")
    ap.add_argument("--repeats", type=int, default=9, help="timed trials per point, the algorithms taking turns")
    ap.add_argument("--iters", type=int, default=10, help="calls per trial (fewer past --max-seconds, at least 2)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=0.5, help="time budget per trial")
    ap.add_argument("--out", type=Path, help="write collectives.csv and collectives.png here")
    a = ap.parse_args()
    rows = []
    for n in (int(x) for x in a.ranks.split(",")):
        opts = BenchOptions(ops=["allreduce"], algos=ALGOS, sizes=parse_sizes(a.sizes), ranks=n, iters=a.iters,
                            warmup=a.warmup, repeats=a.repeats, max_seconds=a.max_seconds).validate()
        with RankPool(n, timeout_s=900) as pool:
            mine = pool.run(bench_rank, opts)[0]
        print(f"\n{n} ranks\n{format_table(mine)}", flush=True)
        rows += mine
    print(f"\ntarget: busbw >= {TARGET}x gloo's native all-reduce (median of the per-repeat ratios)")
    print(f"{'ranks':>5}{'size':>7}  {'algo':<6}{'busbw':>8}{'native':>8}{'ratio':>8}  {'target':<8}"
          f"{'median call (us)':>17}{'stalled':>9}{'native':>10}{'stalled':>9}")
    native = {(r["ranks"], r["size_bytes"]): r for r in rows if r["algo"] == "native"}
    met = True
    for r in rows:
        if r["algo"] == "native":
            continue
        ok = r["vs_native"] >= TARGET and r["correct"]
        met &= ok
        nat = native[(r["ranks"], r["size_bytes"])]
        print(f"{r['ranks']:>5}{human(r['size_bytes']):>7}  {r['algo']:<6}{r['busbw_GBps']:>8.3f}{nat['busbw_GBps']:>8.3f}"
              f"{r['vs_native']:>7.2f}x  {'met' if ok else 'NOT MET':<8}{r['call_median_us']:>17.0f}{r['stalled']:>9.0%}"
              f"{nat['call_median_us']:>10.0f}{nat['stalled']:>9.0%}{'' if r['correct'] else ' (WRONG result)'}")
    print(f"\nall points: {'met' if met else 'NOT MET'}")
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        write_csv(rows, a.out / "collectives.csv")
        for n in {r["ranks"] for r in rows}:
            plot([r for r in rows if r["ranks"] == n], a.out / f"collectives_{n}ranks.png")
        print(f"wrote {a.out}/collectives.csv and the plots")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
