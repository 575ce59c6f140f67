"""Where a run's steps went, and what to change: from the timings every run records.

Per step (mean over the logged windows after the first, which includes start-up), rank 0:

    data          waiting for the next batch (the loader's thread prepares it ahead)
    compute       forward and backward, less the time spent waiting in collectives and the bubble
    exposed comm  time blocked in collectives (plait.comm.accounting times every call; what runs
                  under compute without blocking is hidden and not counted here)
    bubble        the pipeline's idle share (measured from the schedule's timeline)
    optimizer     clipping and the optimizer step

The verdict names the largest avoidable share with the number behind it and the key to change.
Stragglers: each rank's compute time per step (step time minus its waits), against the median.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from plait.report.runfiles import read_metrics

THRESHOLDS = {"data": 0.20, "exposed_comm": 0.25, "bubble": 0.20, "optimizer": 0.25}


def split(step: float, data: float, fb: float, opt: float, wait: float, bubble_fraction: float) -> dict[str, float]:
    """One step's seconds in the categories above, from the phases a metrics record holds (`time`: data,
    forward_backward, optimizer; comm_wait_s) and the pipeline's measured bubble fraction."""
    # the bubble is the idle share of the pipeline schedule's span (the forward-backward phase), and a stage idles
    # in its receives: that time is in the collective wait too, so it is counted once, as bubble
    bubble = min(fb, fb * bubble_fraction)
    exposed = min(fb, max(0.0, wait - bubble))
    return {"data": data, "compute": max(0.0, fb - bubble - exposed), "exposed_comm": exposed, "bubble": bubble,
            "optimizer": opt, "other": max(0.0, step - data - fb - opt)}


def row_split(row: dict, bubble_fraction: float = 0.0) -> dict[str, float]:
    """split() of one metrics record (a logging window's mean step)."""
    t = row["time"]
    return split(row["step_time_s"], t.get("data", 0.0), t.get("forward_backward", 0.0), t.get("optimizer", 0.0),
                 row.get("comm_wait_s", 0.0), bubble_fraction)


def breakdown(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    rows = [m for m in read_metrics(run_dir / "metrics.jsonl") if "step_time_s" in m]
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    steady = rows[1:] if len(rows) > 1 else rows
    if not steady:
        return {}
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0  # noqa: E731
    step = mean([r["step_time_s"] for r in steady])
    data = mean([r["time"].get("data", 0.0) for r in steady])
    fb = mean([r["time"].get("forward_backward", 0.0) for r in steady])
    opt = mean([r["time"].get("optimizer", 0.0) for r in steady])
    wait = mean([r.get("comm_wait_s", 0.0) for r in steady])
    parts = split(step, data, fb, opt, wait, summary.get("pipeline", {}).get("bubble_fraction", 0.0))
    # a resumed run may have changed its world size: judge ranks over the windows of the latest layout
    per_rank = [r["rank_compute_s"] for r in steady if r.get("rank_compute_s")]
    per_rank = [w for w in per_rank if len(w) == len(per_rank[-1])] if per_rank else []
    ranks = [mean([w[i] for w in per_rank]) for i in range(len(per_rank[-1]))] if per_rank else []
    flagged = summary.get("stragglers", {}).get("flagged_windows_per_rank", {})
    return {"step_s": step, "parts": parts, "shares": {k: v / step for k, v in parts.items()} if step else {},
            "rank_compute_s": ranks, "flagged": flagged, "windows": len(steady),
            "comm_bytes": mean([r.get("comm_bytes", 0.0) for r in steady]), "summary": summary}


def verdict(b: dict) -> list[str]:
    """Plain-language findings, largest first, each with its numbers and the key to change."""
    if not b:
        return ["no steps were logged: nothing to judge"]
    s, cfg = b["shares"], b["summary"]
    lines = []
    if s["data"] >= THRESHOLDS["data"]:
        lines.append((s["data"], f"input-bound: {s['data']:.0%} of the step waits on data "
                                 f"({b['parts']['data'] * 1000:.1f} ms); raise data.prefetch or make the source faster"))
    if s["exposed_comm"] >= THRESHOLDS["exposed_comm"]:
        mb = b["comm_bytes"] / 1e6
        lines.append((s["exposed_comm"], f"communication-bound: {s['exposed_comm']:.0%} of the step waits in collectives "
                                         f"({mb:.2f} MB sent per step); try larger micro-batches, gradient "
                                         "compression (parallel.compression) or fewer, bigger data-parallel ranks"))
    if s["bubble"] >= THRESHOLDS["bubble"]:
        p = cfg.get("pipeline", {})
        m, stages = p.get("microbatches", 1), p.get("stages", 2)
        more = 4 * stages
        theory = (stages - 1) / (more + stages - 1)
        fixed, imbalance = p.get("fixed_cost_fraction", 0.0), p.get("imbalance_fraction", 0.0)
        parts = (f"; theory {p.get('bubble_fraction_theory', 0.0):.0%}, unequal slots {imbalance:.0%}, fixed cost "
                 f"{fixed:.0%}") if "fixed_cost_fraction" in p else ""
        if fixed >= max(imbalance, p.get("bubble_fraction_theory", 0.0)):
            fix = (f"the fixed cost between slots leads ({p.get('fixed_cost_ms_per_microbatch', 0.0):.2f} ms per "
                   "micro-batch: sends, receives, the schedule's Python): use fewer, larger micro-batches "
                   "(train.micro_batch_size)")
        elif imbalance >= p.get("bubble_fraction_theory", 0.0):
            fix = "unequal stages lead: balance the blocks per stage (parallel.pp_split)"
        else:
            fix = f"raise parallel.microbatches to {more} (in theory {theory:.0%}) or use the interleaved schedule"
        lines.append((s["bubble"], f"pipeline bubble {s['bubble']:.0%} of the step ({p.get('bubble_fraction', 0.0):.0%} "
                                   f"of the schedule's span{parts}): {m} micro-batches for {stages} stages; {fix}"))
    if s["optimizer"] >= THRESHOLDS["optimizer"]:
        lines.append((s["optimizer"], f"optimizer-bound: {s['optimizer']:.0%} of the step is the optimizer; shard it "
                                      "(parallel.zero=1) or raise the batch per step"))
    ranks = b["rank_compute_s"]
    if len(ranks) > 1:
        med = statistics.median(ranks)
        for r, t in enumerate(ranks):
            if med > 0 and t > 1.5 * med:
                lines.append((t / med, f"straggler: rank {r} computes {t * 1000:.1f} ms per step, {t / med:.1f}x the "
                                       f"median ({med * 1000:.1f} ms); check its host or data"))
    lines.sort(key=lambda x: -x[0])
    if not lines:
        return [f"compute-bound: {s['compute']:.0%} of the step is forward and backward; nothing else takes more than "
                f"{max(v for k, v in s.items() if k != 'compute'):.0%}"]
    return [text for _, text in lines]


def format_report(b: dict) -> str:
    if not b:
        return "no steps were logged"
    out = [f"step {b['step_s'] * 1000:.1f} ms (mean over {b['windows']} logged windows, rank 0):"]
    for k, v in b["parts"].items():
        out.append(f"  {k:13} {v * 1000:9.2f} ms  {b['shares'][k]:6.1%}")
    out.append("verdict:")
    out += [f"  - {line}" for line in verdict(b)]
    if b["rank_compute_s"]:
        out.append("compute per step by rank: " + ", ".join(
            f"{r}: {t * 1000:.1f} ms" + (" (straggler)" if str(r) in b["flagged"] else "")
            for r, t in enumerate(b["rank_compute_s"])))
    return "\n".join(out)


def html(b: dict) -> str:
    import html as h

    if not b:
        return ""
    rows = "".join(f"<tr><th>{k.replace('_', ' ')}</th><td>{v * 1000:.2f} ms</td><td>{b['shares'][k]:.1%}</td></tr>"
                   for k, v in b["parts"].items())
    ranks = "".join(f"<tr><th>rank {r}</th><td>{t * 1000:.2f} ms</td><td>{b['flagged'].get(str(r), 0)}</td></tr>"
                    for r, t in enumerate(b["rank_compute_s"]))
    items = "".join(f"<li>{h.escape(line)}</li>" for line in verdict(b))
    return (f"<h2>where the time goes</h2><p>step {b['step_s'] * 1000:.1f} ms</p><table>{rows}</table>"
            f"<h3>verdict</h3><ul>{items}</ul>"
            + (f"<h3>ranks</h3><table><tr><th></th><th>compute/step</th><th>windows flagged as straggler</th></tr>"
               f"{ranks}</table>" if ranks else ""))
