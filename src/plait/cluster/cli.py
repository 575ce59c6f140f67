"""`plait cluster simulate`: replay a trace of jobs under each scheduling policy and compare them.

    plait cluster simulate --synthetic 1000 --devices 64 [--policy all] [--load 0.9] [--seed 0] [--out DIR]
    plait cluster simulate --trace jobs.csv --devices 16 --policy fifo,tiresias --quantum 360 --switch-cost 10
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from plait.cluster.policies import POLICIES, Params
from plait.errors import ConfigError

# What the papers report against FIFO / YARN-CS on their own traces (for the table's last column; not our measure).
PAPERS = {"tiresias": "avg JCT up to 5.5x better than YARN-CS (Gu et al., NSDI'19)",
          "gandiva": "+26 % cluster utilisation from time-slicing and packing (Xiao et al., OSDI'18)",
          "srtf": "the oracle bound Tiresias compares with (needs job lengths in advance)", "fifo": "baseline"}


def policies(text: str) -> list[str]:
    names = list(POLICIES) if text == "all" else [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise ConfigError(f"--policy {text!r}: {bad[0] if bad else 'nothing'} is not a policy; "
                          f"give all or a comma list of {', '.join(POLICIES)}")
    return names


def format_table(rows: list[dict]) -> str:
    from plait.report.html import human_seconds  # lazily: plait --help must not import matplotlib

    base = next((r for r in rows if r["policy"] == "fifo"), None)
    head = (f"{'policy':<10} {'avg JCT':>13} {'median JCT':>13} {'p95 JCT':>13} {'makespan':>13} "
            f"{'avg queueing':>13} {'preempt.':>8} {'util.':>6} {'fifo avg JCT / it':>17}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{base['avg_jct_s'] / r['avg_jct_s']:.2f}x" if base else "-"
        lines.append(f"{r['policy']:<10} {human_seconds(r['avg_jct_s']):>13} {human_seconds(r['median_jct_s']):>13} "
                     f"{human_seconds(r['p95_jct_s']):>13} {human_seconds(r['makespan_s']):>13} "
                     f"{human_seconds(r['avg_queueing_s']):>13} {r['preemptions']:>8} "
                     f"{r['utilisation'] * 100:>5.1f}% {ratio:>17}")
    return "\n".join(lines)


def plot(results, out: Path) -> Path:
    from plait.report.plots import plt, save  # lazily: matplotlib only when a picture is asked for

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        xs = sorted(j.jct / 3600 for j in r.jobs)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=r.policy)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (hours, log scale)")
    ax.set_ylabel("fraction of jobs")
    ax.grid(alpha=0.3)
    ax.legend()
    return save(fig, out)


def cmd_simulate(a) -> int:
    from plait.cluster.sim import simulate
    from plait.cluster.trace import read_trace, synthetic, write_trace

    if (a.trace is None) == (a.synthetic is None):
        raise ConfigError("give a trace: --trace JOBS.csv (arrival,devices,duration per row) or --synthetic N")
    if a.devices < 1:
        raise ConfigError(f"--devices {a.devices}: the cluster needs at least 1 device")
    if a.quantum <= 0 or a.switch_cost < 0:
        raise ConfigError("--quantum must be > 0 seconds and --switch-cost >= 0 seconds")
    names = policies(a.policy)
    trace = read_trace(a.trace) if a.trace else synthetic(a.synthetic, a.devices, a.seed, a.load)
    params = Params(quantum=a.quantum, promote=a.promote,
                    thresholds=tuple(float(t) for t in a.thresholds.split(",")) if a.thresholds else Params().thresholds)
    results = []
    for name in names:
        t0 = time.perf_counter()
        results.append(simulate(trace, a.devices, name, params, a.switch_cost))
        took = time.perf_counter() - t0
        print(f"simulated {name}: {len(trace)} jobs on {a.devices} devices in {took:.2f} s")
    rows = [r.summary() for r in results]
    print(format_table(rows))
    for name in names:
        print(f"  {name}: {PAPERS[name]}")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        write_trace(trace, out / "trace.csv")
        (out / "results.json").write_text(json.dumps({"params": {"quantum": params.quantum, "thresholds": list(
            params.thresholds), "promote": params.promote, "switch_cost": a.switch_cost}, "policies": rows}, indent=1))
        png = plot(results, out / "jct_cdf.png")
        print(f"wrote {out / 'results.json'}, {out / 'trace.csv'} and {png}")
    return 0


def add_parsers(sub, bench) -> None:
    c = sub.add_parser("cluster", help="share a cluster among plait jobs: scheduling policies and their simulator")
    csub = c.add_subparsers(dest="cluster_cmd", required=True)
    s = csub.add_parser("simulate", help="replay a trace of jobs under scheduling policies (simulated clock)",
                        formatter_class=__import__("argparse").ArgumentDefaultsHelpFormatter)
    s.add_argument("--trace", type=Path, help="CSV with arrival,devices,duration[,id] per job (seconds)")
    s.add_argument("--synthetic", type=int, metavar="N", help="draw N jobs (Poisson arrivals, heavy-tailed lengths)")
    s.add_argument("--devices", type=int, required=True, help="device slots in the cluster")
    s.add_argument("--policy", default="all", help=f"all, or a comma list of {', '.join(POLICIES)}")
    s.add_argument("--quantum", type=float, default=Params().quantum,
                   help="seconds: gandiva's shortest turn, and how often time-sliced policies decide")
    s.add_argument("--thresholds", help="tiresias: queue boundaries in device-seconds, comma separated "
                                        f"(default {','.join(str(t) for t in Params().thresholds)})")
    s.add_argument("--promote", type=float, default=Params().promote,
                   help="tiresias: a job that waited longer than this x its run time returns to the top queue")
    s.add_argument("--switch-cost", type=float, default=10.0,
                   help="seconds a preempted job spends restoring its checkpoint when it runs again")
    s.add_argument("--load", type=float, default=0.9, help="--synthetic: offered load as a fraction of the devices")
    s.add_argument("--seed", type=int, default=0, help="--synthetic: random seed")
    s.add_argument("--out", help="write results.json, trace.csv and jct_cdf.png here")
    s.set_defaults(fn=cmd_simulate)
