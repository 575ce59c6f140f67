"""A federated run directory and its report: accuracy per round, each client's label histogram.

Run directory (like training's): config.toml, partition.json (each client's label counts),
metrics.jsonl (one line per round), summary.json, model.safetensors (the final global model,
plain parameter names), report.html with accuracy.png and labels.png. A comparison
(`plait fed simulate --compare ...`) has one such directory per strategy plus a report.html and
summary.json of its own with the accuracy curves together and the rounds each needed to reach 90 %.
"""

from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from plait.config import dump_config
from plait.federated.partition import label_histograms
from plait.federated.wire import FederatedError
from plait.models import model_metadata
from plait.report import read_metrics
from plait.report.plots import plt, save
from plait.train.metrics import MetricsWriter

if TYPE_CHECKING:
    from plait.config import Config
    from plait.federated.client import FederatedData

TARGET = 0.9  # rounds_to_90 is the first round whose test accuracy reaches this


def rounds_to(records: list[dict], target: float = TARGET) -> int | None:
    """The first round with test_accuracy >= target (None if never)."""
    return next((r["round"] for r in records if r.get("test_accuracy", 0.0) >= target), None)


class RunRecorder:
    """Writes a federated run directory as the rounds go."""

    def __init__(self, run_dir: str | Path | None, cfg: Config, data: FederatedData):
        self.cfg, self.records, self.t0 = cfg, [], time.perf_counter()
        self.spec = data.bundle.spec
        self.hist = label_histograms(data.labels, data.parts, data.bundle.spec.num_classes)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.writer = MetricsWriter(None)
        if self.run_dir is None:
            return
        if (self.run_dir / "metrics.jsonl").exists():
            raise FederatedError(f"--out {self.run_dir} already holds a federated run; choose another --out")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(dump_config(cfg))
        (self.run_dir / "partition.json").write_text(json.dumps(
            {"scheme": cfg.federated.partition, "alpha": cfg.federated.alpha, "label_counts": self.hist.tolist()}))
        self.writer = MetricsWriter(self.run_dir / "metrics.jsonl")

    def write_endpoint(self, host: str, port: int, tls: bool) -> None:
        if self.run_dir is not None:
            tmp = self.run_dir / "endpoint.json.tmp"
            tmp.write_text(json.dumps({"host": host, "port": port, "tls": tls}))
            tmp.replace(self.run_dir / "endpoint.json")

    def write_round(self, record: dict) -> None:
        self.records.append(record)
        self.writer.write(record)

    def finish(self, weights: dict, strategy: str) -> dict:
        """Write summary.json, model.safetensors and report.html; return the summary."""
        f = self.cfg.federated
        last = self.records[-1] if self.records else {}
        summary = {
            "strategy": strategy, "test_accuracy": last.get("test_accuracy"), "test_loss": last.get("test_loss"),
            "best_test_accuracy": max((r["test_accuracy"] for r in self.records), default=None),
            "rounds": len(self.records), "rounds_to_90": rounds_to(self.records), "clients": f.clients,
            "partition": f.partition, "alpha": f.alpha, "local_epochs": f.local_epochs, "local_lr": f.local_lr,
            "secure_aggregation": f.secure_aggregation, "aggregator": f.aggregator,
            "skipped_rounds": sum(1 for r in self.records if r.get("skipped")),
            "wall_time_s": time.perf_counter() - self.t0,
        }
        if "epsilon" in last:
            summary.update(epsilon=last["epsilon"], delta=f.dp_delta, noise_multiplier=f.dp_noise_multiplier)
        self.writer.close()
        if self.run_dir is not None:
            from safetensors.torch import save_file

            md = model_metadata(self.cfg.model, self.spec)  # the format `plait export` writes: serve loads it as is
            meta = {"format": "pt", "plait.model": json.dumps(md["model"]), "plait.spec": json.dumps(md["spec"]),
                    "plait.federated": strategy}
            save_file({k: v.contiguous() for k, v in weights.items()}, str(self.run_dir / "model.safetensors"), metadata=meta)
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
            if self.cfg.log.report:
                write_fed_report(self.run_dir)
        return summary


# --------------------------------------------------------------------------- plots


def accuracy_plot(runs: dict[str, list[dict]], out: Path, target: float = TARGET) -> Path | None:
    """Test accuracy per round, one line per run, with the target and the round each reached it."""
    if not any(runs.values()):
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    styles = ("-", "--", "-.", ":")  # overlapping curves (FedAvg and FedProx with a small mu) stay visible
    for i, (name, records) in enumerate(runs.items()):
        if not records:
            continue
        line, = ax.plot([r["round"] for r in records], [r["test_accuracy"] for r in records], lw=1.8, ls=styles[i % 4],
                        label=f"{name} ({rounds_to(records, target) or '-'} rounds to {target:.0%})")
        hit = rounds_to(records, target)
        if hit is not None:
            ax.axvline(hit, ls=":", c=line.get_color(), alpha=0.7)
    ax.axhline(target, ls="--", c="gray", lw=1)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, out)
    return out


def label_plot(hist: np.ndarray, out: Path, title: str = "") -> Path | None:
    """Each client's label histogram as a stacked bar (one colour per label)."""
    hist = np.asarray(hist)
    if hist.size == 0:
        return None
    clients, classes = hist.shape
    fig, ax = plt.subplots(figsize=(max(6, min(16, clients * 0.35)), 4))
    bottom = np.zeros(clients)
    colors = plt.get_cmap("tab10" if classes <= 10 else "tab20")
    for c in range(classes):
        ax.bar(np.arange(clients), hist[:, c], bottom=bottom, label=str(c), color=colors(c % colors.N), width=0.85)
        bottom += hist[:, c]
    ax.set_xlabel("client")
    ax.set_ylabel("training samples")
    ax.set_title(title or "label histogram per client")
    if classes <= 20:
        ax.legend(title="label", fontsize=7, ncol=2, bbox_to_anchor=(1.01, 1), loc="upper left")
    save(fig, out)
    return out


LABELS = {  # summary.json key -> what the report calls it
    "strategy": "strategy", "test_accuracy": "final test accuracy", "best_test_accuracy": "best test accuracy",
    "test_loss": "final test loss", "rounds": "rounds run", "rounds_to_90": "rounds to 90 % test accuracy",
    "clients": "clients", "partition": "partition", "alpha": "Dirichlet alpha", "local_epochs": "local epochs",
    "local_lr": "local learning rate", "secure_aggregation": "secure aggregation", "aggregator": "aggregator",
    "skipped_rounds": "rounds skipped (too few clients)", "wall_time_s": "wall time", "epsilon": "privacy epsilon",
    "delta": "privacy delta", "noise_multiplier": "noise multiplier",
}


def human(key: str, value, summary: dict) -> str:
    """One summary value in the units a reader expects: accuracies in %, seconds with "s", a missing figure in words."""
    if key == "rounds_to_90":
        return str(value) if value else f"not reached in {summary.get('rounds', '?')} rounds"
    if value is None:
        return "n/a"
    if key.endswith("accuracy") and isinstance(value, (int, float)):
        return f"{100 * value:.1f} %"
    if key == "wall_time_s":
        return f"{value:.1f} s"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def rounds_ratios(table: dict) -> dict[str, float]:
    """Each strategy's rounds to 90 % over FedAvg's, only where both reached it (no ratio against a missing figure)."""
    base = table.get("fedavg", {}).get("rounds_to_90")
    return {f"{name}_over_fedavg_rounds": row["rounds_to_90"] / base for name, row in table.items()
            if name != "fedavg" and base and row.get("rounds_to_90")}


def ratio_line(name: str, table: dict) -> str:
    """e.g. "fedprox reached 90 % in 0.8x FedAvg's rounds (12 vs 15)"."""
    mine, base = table[name]["rounds_to_90"], table["fedavg"]["rounds_to_90"]
    return f"{name} reached 90 % in {mine / base:.2f}x FedAvg's rounds ({mine} vs {base})"


def _table(summary: dict) -> str:
    return "<table>" + "".join(
        f"<tr><th>{html.escape(LABELS.get(k, k.replace('_', ' ')))}</th><td>{html.escape(human(k, v, summary))}</td></tr>"
        for k, v in summary.items()) + "</table>"


def _page(title: str, body: str) -> str:
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:70em}} th{{text-align:left;padding-right:1em}}
td{{padding-right:1em}} img{{max-width:100%;margin:0.5em 0}}</style></head>
<body><h1>{html.escape(title)}</h1>
{body}
</body></html>
"""


def write_fed_report(run_dir: str | Path) -> Path:
    """run_dir/report.html from metrics.jsonl, summary.json and partition.json."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    part = json.loads((run_dir / "partition.json").read_text()) if (run_dir / "partition.json").is_file() else {}
    acc = accuracy_plot({summary.get("strategy", "global model"): records}, run_dir / "accuracy.png")
    labels = label_plot(np.array(part.get("label_counts", [])), run_dir / "labels.png",
                        f"label histogram per client ({part.get('scheme', '?')}, alpha = {part.get('alpha', '?')})")
    imgs = "".join(f'<img src="{p.name}" alt="{p.stem}">' for p in (acc, labels) if p is not None)
    out = run_dir / "report.html"
    out.write_text(_page(f"plait fed run {run_dir.name}", _table(summary) + "<h2>plots</h2>" + imgs))
    return out


def write_compare_report(out_dir: str | Path, run_dirs: dict[str, Path]) -> dict:
    """Combined summary.json and report.html of several strategies' runs (e.g. FedAvg vs FedSGD vs FedProx)."""
    out_dir = Path(out_dir)
    runs = {name: read_metrics(d / "metrics.jsonl") for name, d in run_dirs.items()}
    summaries = {name: json.loads((d / "summary.json").read_text()) for name, d in run_dirs.items()}
    table = {name: {k: s.get(k) for k in ("rounds_to_90", "test_accuracy", "best_test_accuracy", "rounds", "wall_time_s")}
             for name, s in summaries.items()}
    summary: dict = {"strategies": table, **rounds_ratios(table)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    acc = accuracy_plot(runs, out_dir / "accuracy.png")
    rows = "".join(
        f"<tr><td>{html.escape(n)}</td>" + "".join(f"<td>{html.escape(human(k, r[k], r))}</td>" for k in
                                                   ("rounds_to_90", "test_accuracy", "rounds", "wall_time_s")) + "</tr>"
        for n, r in table.items())
    ratios = "".join(f"<p>{html.escape(ratio_line(k.split('_over_')[0], table))}</p>" for k in rounds_ratios(table))
    body = ("<table><tr><th>strategy</th><th>rounds to 90 %</th><th>final test accuracy</th><th>rounds run</th>"
            f"<th>wall time</th></tr>{rows}</table>{ratios}<h2>accuracy per round</h2>"
            + (f'<img src="{acc.name}" alt="accuracy">' if acc else "")
            + "".join(f'<p><a href="{html.escape(n)}/report.html">{html.escape(n)} run</a></p>' for n in run_dirs))
    (out_dir / "report.html").write_text(_page(f"plait fed comparison {out_dir.name}", body))
    return summary
