"""What `plait cluster run` and `plait cluster simulate` do (their parsers: plait.cluster.cli): the queue run on
this machine's slots (or Slurm's), the trace replayed under each policy, their tables and pictures.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from plait.cluster.cli import PAPERS
from plait.cluster.policies import POLICIES, Params
from plait.cluster.run import LocalCluster, SlurmQueue, gantt, read_jobs
from plait.cluster.sim import simulate
from plait.cluster.trace import read_trace, synthetic, write_trace
from plait.errors import ConfigError
from plait.report.html import human_seconds
from plait.report.plots import plt, save
from plait.rundir import timestamped


def policies(text: str) -> list[str]:
    names = list(POLICIES) if text == "all" else [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise ConfigError(f"--policy {text!r}: {bad[0] if bad else 'nothing'} is not a policy; "
                          f"give all or a comma list of {', '.join(POLICIES)}")
    return names


def format_table(rows: list[dict]) -> str:
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
    if (a.trace is None) == (a.synthetic is None):
        raise ConfigError("give a trace: --trace JOBS.csv (arrival,devices,duration per row) or --synthetic N")
    if a.devices < 1:
        raise ConfigError(f"--devices {a.devices}: the cluster needs at least 1 device")
    if a.switch_cost < 0:
        raise ConfigError(f"--switch-cost {a.switch_cost}: give seconds >= 0")
    names = policies(a.policy)
    params = _params(a)
    trace = read_trace(a.trace) if a.trace else synthetic(a.synthetic, a.devices, a.seed, a.load)
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


def _params(a) -> Params:
    if a.quantum <= 0:
        raise ConfigError(f"--quantum {a.quantum}: give a positive number of seconds")
    try:
        thresholds = tuple(float(t) for t in a.thresholds.split(",")) if a.thresholds else Params().thresholds
    except ValueError:
        raise ConfigError(f"--thresholds {a.thresholds!r}: give device-seconds separated by commas, e.g. 3200,25600"
                          ) from None
    return Params(quantum=a.quantum, promote=a.promote, thresholds=thresholds)


def format_jobs(rows: list[dict]) -> str:
    def sec(v):
        return human_seconds(v) if v is not None else "-"

    head = f"{'job':<12} {'steps':>6} {'arrival':>9} {'queueing':>10} {'completion':>11} {'preempt.':>8} {'procs':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['job']:<12} {r['steps']:>6} {sec(r['arrival_s']):>9} {sec(r['queueing_s']):>10} "
                     f"{sec(r['completion_s']):>11} {r['preemptions']:>8} {','.join(map(str, r['procs'])):>8}"
                     + (f"  FAILED: {r['failed']}" if r["failed"] else ""))
    return "\n".join(lines)


def cmd_run(a) -> int:
    if a.slots < 1:
        raise ConfigError(f"--slots {a.slots}: give at least 1 process slot")
    policies(a.policy)
    if a.policy == "all" or "," in a.policy:
        raise ConfigError(f"--policy {a.policy!r}: a real run takes one policy; compare several with plait cluster "
                          f"simulate")
    specs = read_jobs(a.jobs, a.slots)
    out = Path(a.out) if a.out else timestamped("cluster")
    out.mkdir(parents=True, exist_ok=True)
    print(f"plait cluster run: {len(specs)} jobs on {a.slots} slots, policy {a.policy}; runs in {out / 'jobs'}",
          flush=True)
    if a.backend == "slurm":
        c = SlurmQueue(specs, a.slots, a.policy, out, _params(a), poll=a.poll, time_limit=a.time,
                       partition=a.partition)
    else:
        c = LocalCluster(specs, a.slots, a.policy, out, _params(a), poll=a.poll)
    try:
        c.run(timeout=a.timeout)
    except KeyboardInterrupt:
        c.stop_all()  # every running job checkpoints; `plait train --resume` continues any of them
        raise
    summary = c.summary()
    (out / "cluster.json").write_text(json.dumps(summary, indent=1))
    png = gantt(c, out / "gantt.png")
    print(format_jobs(summary["jobs"]))
    print(f"makespan {human_seconds(summary['makespan_s'])}, slot utilisation "
          f"{summary['slot_utilisation'] * 100:.1f} %, average completion {human_seconds(summary['avg_completion_s'])}")
    print(f"wrote {out / 'cluster.json'} and {png}")
    return 1 if any(r["failed"] for r in summary["jobs"]) else 0
