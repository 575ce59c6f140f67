"""report.html: the summary as a table, the loss curve, the step-time breakdown (and an MoE run's expert load)."""

from __future__ import annotations

import html
import json
from pathlib import Path

from plait.report.bottleneck import breakdown
from plait.report.bottleneck import html as bottleneck_html
from plait.report.plots import expert_load, loss_curve, step_time_breakdown
from plait.report.runfiles import read_metrics


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    return str(v)


def write_report(run_dir: str | Path) -> Path:
    """Write run_dir/report.html and its PNG plots from metrics.jsonl and summary.json."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    plots = [
        loss_curve(metrics, run_dir / "loss.png", summary.get("unigram_val_loss")),
        step_time_breakdown(metrics, run_dir / "step_time.png"),
        expert_load(metrics, run_dir / "expert_load.png"),
    ]
    rows = "\n".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>"
        for k, v in summary.items() if k != "sample"
    )
    plots += [run_dir / name for name in ("pipeline.png",) if (run_dir / name).is_file()]
    imgs = "\n".join(f'<img src="{p.name}" alt="{p.stem}">' for p in plots if p is not None)
    where = bottleneck_html(breakdown(run_dir))
    sample = f"<h2>sample</h2><pre>{html.escape(summary['sample'])}</pre>" if summary.get("sample") else ""
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>plait run {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:60em}} th{{text-align:left;padding-right:1em}}
img{{max-width:48%;margin:0.5%}} pre{{background:#f4f4f4;padding:1em;white-space:pre-wrap}}</style></head>
<body><h1>plait run {html.escape(run_dir.name)}</h1>
<table>{rows}</table>
{where}
<h2>plots</h2>{imgs}
{sample}
</body></html>
"""
    out = run_dir / "report.html"
    out.write_text(page)
    return out
