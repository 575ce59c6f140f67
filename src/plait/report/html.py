"""report.html: the run in human units (overview, memory and traffic per rank, stragglers), where the time
goes, the curves (loss, validation loss, learning rate, gradient norm, throughput), the step-time breakdown,
an MoE run's expert load, the resolved config and a generated sample. Nothing is printed as a raw dict."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from plait.report.bottleneck import breakdown
from plait.report.bottleneck import html as bottleneck_html
from plait.report.plots import expert_load, freeze_points, loss_curve, preference_rewards, step_time_breakdown, training_curves
from plait.report.runfiles import read_metrics

STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:64em;color:#222}
table{border-collapse:collapse;margin:0.5em 0 1.5em} th,td{padding:0.25em 0.9em;border-bottom:1px solid #e4e4e4}
th{text-align:left;font-weight:600} td.n{text-align:right;font-variant-numeric:tabular-nums}
img{max-width:100%;margin:0.5em 0} pre{background:#f5f5f5;padding:1em;white-space:pre-wrap;font-size:90%}
h2{margin-top:1.6em;border-bottom:2px solid #ddd}"""

# the overview's rows, in this order (other summary keys follow under "more")
OVERVIEW = ("steps", "resumed_from_step", "preempted", "initial_loss", "final_loss", "val_loss", "unigram_val_loss",
            "world_size", "parallel", "global_batch_size", "micro_batch_size", "grad_accum", "precision", "device",
            "backend", "params", "trainable_params", "wall_time_s", "train_time_s", "tokens_per_s", "samples_per_s",
            "time_to_target", "device_hours", "cost")
SHOWN_ELSEWHERE = {"memory", "comm", "stragglers", "sample", "continual"}
LABELS = {"val_loss": "validation loss", "unigram_val_loss": "unigram baseline (validation)", "grad_accum":
          "gradient accumulation", "wall_time_s": "wall time", "train_time_s": "training time", "tokens_per_s":
          "throughput (tokens/s)", "samples_per_s": "throughput (samples/s)", "params": "parameters",
          "trainable_params": "trainable parameters", "resumed_from_step": "resumed from step", "world_size":
          "processes", "time_to_target": "time to target (train.target)", "device_hours": "device-hours (this session)",
          "cost": "cost (launch.device_hour_cost)"}


def label(key: str) -> str:
    return LABELS.get(key, key.replace("_per_", " per ").replace("_", " "))


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def human_seconds(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.3g} ms"
    if s < 120:
        return f"{s:.3g} s"
    m, sec = divmod(round(s), 60)
    return f"{m} min {sec} s" if m < 60 else f"{m // 60} h {m % 60} min"


def target_text(t: dict) -> str:
    """summary.json's time_to_target in words."""
    sign = "<=" if t["metric"] == "val_loss" else ">="
    if not t.get("reached"):
        return f"{t['metric']} {sign} {t['target']:g} not reached in {t['steps']:,} steps"
    seen = f"{t['tokens']:,} tokens" if "tokens" in t else f"{t['samples']:,} samples"
    cost = f", cost {t['cost']:.4g}" if "cost" in t else ""
    return (f"{t['metric']} {sign} {t['target']:g} at step {t['step']:,}: {human_seconds(t['wall_time_s'])}, {seen}, "
            f"{t['device_hours']:.3g} device-hours{cost}")


def human(key: str, v) -> str:
    """A value for people: bytes in KiB/MiB/GiB, seconds in ms/s/min, counts with separators, no raw containers."""
    if v is None:
        return "-"
    if key == "time_to_target" and isinstance(v, dict):
        return target_text(v)
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)) and not (isinstance(v, float) and not math.isfinite(v)):
        if key.endswith("bytes") or "_bytes_" in key:
            return human_bytes(v)
        if key.endswith("_s") and not key.endswith("per_s"):
            return human_seconds(v)
        if isinstance(v, int) or (key.endswith("params") and float(v).is_integer()):
            return f"{int(v):,}"
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(human(key, x) for x in v) if all(not isinstance(x, (dict, list)) for x in v) else \
            f"{len(v)} entries"
    if isinstance(v, dict):
        return ", ".join(f"{label(k)} {human(k, x)}" for k, x in v.items())
    return str(v)


def kv_table(items) -> str:
    rows = []
    for k, v in items:
        if isinstance(v, dict) and v and any(isinstance(x, (dict, list)) for x in v.values()):
            cell = kv_table(v.items())  # nested: a table in the cell
        else:
            cell = html.escape(human(k, v))
        num = isinstance(v, (int, float)) and not isinstance(v, bool)
        rows.append(f"<tr><th>{html.escape(label(k))}</th><td{' class=n' if num else ''}>{cell}</td></tr>")
    return f"<table>{''.join(rows)}</table>"


def per_rank_table(rows: list[dict], caption: str) -> str:
    """One row per rank, one column per figure (each in its unit)."""
    keys = [k for k in rows[0]] if rows else []
    head = "".join(f"<th>{html.escape(label(k.removesuffix('_bytes')))}</th>" for k in keys)
    body = "".join(
        f"<tr><th>rank {r}</th>" + "".join(f"<td class=n>{html.escape(human(k, row.get(k)))}</td>" for k in keys) + "</tr>"
        for r, row in enumerate(rows))
    return f"<h3>{html.escape(caption)}</h3><table><tr><th></th>{head}</tr>{body}</table>"


def forgetting_table(c: dict) -> str:
    """data.stream: each task's validation figure after each task, and how much each task forgot."""
    tasks = range(len(c["rows"][-1]["values"])) if c.get("rows") else range(0)
    head = "".join(f"<th>task {j}</th>" for j in tasks)
    body = "".join(f"<tr><th>after task {r['after_task']} (step {r['step']})</th>"
                   + "".join(f"<td class=n>{v:.3f}</td>" for v in r["values"]) + "</tr>" for r in c.get("rows", []))
    body += "<tr><th>forgetting</th>" + "".join(
        f"<td class=n>{'' if f is None else f'{f:.3f}'}</td>" for f in c.get("forgetting", [])) + "</tr>"
    what = f"{html.escape(c.get('metric', ''))} on each task's validation split"
    return (f"<h2>continual learning</h2><p>{what}; data.replay {c.get('replay', 0)}, train.ewc {c.get('ewc', 0)}</p>"
            f"<table><tr><th></th>{head}</tr>{body}</table>")


def sections(summary: dict) -> str:
    parts = ["<h2>overview</h2>", kv_table([(k, summary[k]) for k in OVERVIEW if k in summary])]
    per_rank = (summary.get("memory") or {}).get("per_rank")
    comm = (summary.get("comm") or {}).get("bytes_per_step_per_rank")
    if per_rank or comm:
        parts.append("<h2>per rank</h2>")
    if per_rank:
        parts.append(per_rank_table(per_rank, "memory"))
    if comm:
        parts.append(per_rank_table([{"sent_per_step_bytes": b} for b in comm], "communication"))
    st = summary.get("stragglers")
    if st is not None:
        flagged = st.get("flagged_windows_per_rank") or {}
        text = ("none: no rank was slower than " if not flagged else
                "; ".join(f"rank {r}: {n} logging windows" for r, n in flagged.items()) + "; slower than ")
        parts.append(f"<h3>stragglers</h3><p>{html.escape(text)}{st.get('factor', 1.5):g} x the median step</p>")
    if summary.get("continual"):
        parts.append(forgetting_table(summary["continual"]))
    more = [(k, v) for k, v in summary.items() if k not in OVERVIEW and k not in SHOWN_ELSEWHERE]
    if more:
        parts += ["<h2>more</h2>", kv_table(more)]
    return "\n".join(parts)


def write_report(run_dir: str | Path) -> Path:
    """Write run_dir/report.html and its PNG plots from metrics.jsonl, summary.json and config.toml."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    plots = [
        training_curves(metrics, run_dir / "curves.png"),
        loss_curve(metrics, run_dir / "loss.png", summary.get("unigram_val_loss")),
        step_time_breakdown(metrics, run_dir / "step_time.png", summary.get("pipeline", {}).get("bubble_fraction", 0.0)),
        expert_load(metrics, run_dir / "expert_load.png"),
        freeze_points(metrics, run_dir / "freeze.png"),
        preference_rewards(metrics, run_dir / "preference.png"),
    ]
    plots += [run_dir / name for name in ("pipeline.png",) if (run_dir / name).is_file()]
    imgs = "\n".join(f'<img src="{p.name}" alt="{p.stem}">' for p in plots if p is not None)
    where = bottleneck_html(breakdown(run_dir))
    sample = f"<h2>sample</h2><pre>{html.escape(summary['sample'])}</pre>" if summary.get("sample") else ""
    config = run_dir / "config.toml"
    cfg = (f"<h2>config</h2><details><summary>the resolved config.toml</summary><pre>"
           f"{html.escape(config.read_text())}</pre></details>") if config.is_file() else ""
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>plait run {html.escape(run_dir.name)}</title>
<style>{STYLE}</style></head>
<body><h1>plait run {html.escape(run_dir.name)}</h1>
{sections(summary) if summary else "<p>no summary.json yet: the run has not finished</p>"}
{where}
<h2>plots</h2>{imgs}
{sample}
{cfg}
</body></html>
"""
    out = run_dir / "report.html"
    out.write_text(page)
    return out
