"""`plait runs compare RUN...`: one HTML page with a table of the runs' figures and their loss curves overlaid.

Runs with a train.target are ranked by their time to it (those that reached it, fastest first)."""

from __future__ import annotations

import html
import json
import time
from pathlib import Path

from plait.errors import PlaitError
from plait.report.html import STYLE, human
from plait.report.plots import compare_curves
from plait.report.runfiles import read_metrics

# the table's columns: (summary key, heading)
COLUMNS = (("steps", "steps"), ("parallel", "layout"), ("params", "parameters"), ("final_loss", "final loss"),
           ("val_loss", "validation loss"), ("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s"),
           ("wall_time_s", "wall time"), ("world_size", "processes"), ("time_to_target", "time to target"))


def _rank(summaries: dict[str, dict]) -> dict[str, dict]:
    """With a train.target in any run: the runs that reached it first, fastest first (wall time), then the rest."""
    if not any("time_to_target" in s for s in summaries.values()):
        return summaries

    def key(item):
        t = item[1].get("time_to_target") or {}
        return (0, t["wall_time_s"]) if t.get("reached") else (1, 0.0)

    return dict(sorted(summaries.items(), key=key))


class CompareError(PlaitError):
    """A directory that is not a finished run."""


def _layout(parallel) -> str:
    if not isinstance(parallel, dict):
        return human("parallel", parallel)
    axes = " x ".join(f"{k}{v}" for k, v in parallel.items() if isinstance(v, int) and v > 1) or "1 process"
    return f"{axes} ({parallel.get('strategy', '?')})"


def config_diff(run_dirs: dict[str, Path]) -> list[tuple[str, list]]:
    """(section.key, [value in each run]) for every config key whose value is not the same in all the runs (a key
    a run's config.toml lacks shows as None)."""
    import tomllib

    flat = {}
    for name, d in run_dirs.items():
        try:
            cfg = tomllib.loads((d / "config.toml").read_text())
        except (OSError, ValueError):
            cfg = {}
        flat[name] = {f"{sec}.{k}": v for sec, keys in cfg.items() if isinstance(keys, dict) for k, v in keys.items()}
    keys = sorted(set().union(*(f.keys() for f in flat.values())))
    return [(k, [flat[n].get(k) for n in run_dirs]) for k in keys if len({json.dumps(flat[n].get(k)) for n in run_dirs}) > 1]


def _diff_table(names: list[str], diff: list[tuple[str, list]]) -> str:
    if not diff:
        return "<h2>what differs</h2><p>the runs' configs are the same</p>"
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names)
    rows = "".join(f"<tr><th>{html.escape(k)}</th>" + "".join(f"<td>{html.escape(json.dumps(v))}</td>" for v in vals)
                   + "</tr>" for k, vals in diff)
    return f"<h2>what differs</h2><table><tr><th>config key</th>{head}</tr>{rows}</table>"


def compare_runs(run_dirs: list[Path], out_dir: Path | None = None) -> Path:
    """Write out_dir/compare.html and compare.png for the runs; returns the page's path."""
    if len(run_dirs) < 2:
        raise CompareError("plait runs compare needs at least two run directories")
    runs, summaries, dirs = {}, {}, {}
    for d in map(Path, run_dirs):
        if not (d / "metrics.jsonl").is_file():
            raise CompareError(f"{d} has no metrics.jsonl; pass the --out directories of training runs")
        name = d.name if d.name not in runs else str(d)
        runs[name], dirs[name] = read_metrics(d / "metrics.jsonl"), d
        summaries[name] = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else {}
    out_dir = Path(out_dir) if out_dir else Path("runs") / time.strftime("compare-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = _rank(summaries)
    cols = [(k, h) for k, h in COLUMNS if any(k in s for s in summaries.values())]
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h in cols)
    rows = "".join(
        f"<tr><th>{html.escape(name)}</th>" + "".join(
            f"<td class=n>{html.escape(_layout(s.get(k)) if k == 'parallel' else human(k, s.get(k)))}</td>"
            for k, _ in cols) + "</tr>"
        for name, s in summaries.items())
    plot = compare_curves(runs, out_dir / "compare.png")
    img = f'<img src="{plot.name}" alt="loss curves">' if plot else "<p>no losses logged</p>"
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>plait: {len(runs)} runs compared</title><style>{STYLE}</style></head>
<body><h1>{len(runs)} runs compared</h1>
<table><tr><th>run</th>{head}</tr>{rows}</table>
{_diff_table(list(dirs), config_diff(dirs))}
<h2>loss</h2>{img}
</body></html>
"""
    out = out_dir / "compare.html"
    out.write_text(page)
    return out
