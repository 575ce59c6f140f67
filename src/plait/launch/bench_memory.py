"""`plait bench memory [CONFIG]`: ZeRO stages 0-3 side by side, measured memory next to the paper's formula.

Each stage runs a few steps of the configured job through the normal launcher (so it runs
wherever `plait train` runs, GPU included), then its summary's per-rank accounting is put
in a table with the ZeRO paper's model-state bytes for fp32 AdamW (K = 8):

    stage 0: 16 Psi      stage 1: 8 Psi + 8 Psi / N
    stage 2: 4 Psi + 12 Psi / N      stage 3: 16 Psi / N

(FSDP2 also shards parameters at rest at stage 2, which only lowers it), plus step time and
bytes sent per step; a PNG bar chart shows the same.
"""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path

from plait.config import Config, dump_config
from plait.errors import ConfigError
from plait.launch import launch
from plait.parallel.layout import Layout
from plait.report.plots import plt, save
from plait.train.job import check_job

MIB = 1024 * 1024


def formula_bytes(stage: int, psi: int, n: int, k: int = 8) -> float:
    """Model-state bytes per rank for fp32 parameters and gradients and K bytes of optimizer state per parameter."""
    full = {0: (4, 4, k), 1: (4, 4, k / n), 2: (4, 4 / n, k / n), 3: (4 / n, 4 / n, k / n)}[stage]
    return sum(full) * psi


def optimizer_state_bytes_per_param(cfg: Config) -> int | None:
    """K of the ZeRO paper for this optimizer in fp32: AdamW keeps 2 moments, SGD with momentum 1."""
    if cfg.precision.dtype != "fp32":
        return None
    if cfg.optim.name == "adamw":
        return 8
    return 4 if cfg.optim.momentum else 0


def stage_config(base: Config, zero: int, steps: int) -> Config:
    cfg = copy.deepcopy(base)
    cfg.parallel.zero = zero
    cfg.train.steps, cfg.train.stop_after = steps, 0
    cfg.train.sample_tokens, cfg.train.eval_samples = 0, cfg.train.eval_batch_size
    cfg.checkpoint.every = 0
    cfg.log.every, cfg.log.progress, cfg.log.report = 1, False, False
    check_job(cfg)
    return cfg


def run_stages(base: Config, out: Path, steps: int = 6) -> list[dict]:
    """Train each ZeRO stage for `steps` steps under out/zeroK; returns one row per stage."""
    if base.parallel.dp < 2:
        raise ConfigError(f"plait bench memory compares ZeRO stages over dp ranks; parallel.dp = {base.parallel.dp}, "
                          "set --set parallel.dp=2 (or more)")
    rows = []
    for zero in range(4):
        cfg = stage_config(base, zero, steps)
        run_dir = out / f"zero{zero}"
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(dump_config(cfg))
        print(f"zero={zero}: {steps} steps on {Layout.from_config(cfg).world_size} processes ...", flush=True)
        code = launch(cfg, run_dir)
        if code:
            raise ConfigError(f"the zero={zero} run failed (exit code {code}); see {run_dir / 'logs'}")
        rows.append(collect(run_dir, zero, cfg))
    return rows


def collect(run_dir: Path, zero: int, cfg: Config) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [m["step_time_s"] for m in metrics if "step_time_s" in m and m["step"] > 1]
    per_rank = summary["memory"]["per_rank"]
    worst = max(per_rank, key=lambda m: m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"])
    k = optimizer_state_bytes_per_param(cfg)
    n = cfg.parallel.dp
    return {
        "zero": zero, "psi": summary["params"], "n": n, **worst,
        "model_state_bytes": worst["params_bytes"] + worst["grads_bytes"] + worst["optimizer_bytes"],
        "formula_bytes": formula_bytes(zero, summary["params"], n, k) if k is not None else None,
        "step_time_s": statistics.median(times) if times else summary["train_time_s"] / summary["steps"],
        "comm_bytes": max(summary["comm"]["bytes_per_step_per_rank"]),
    }


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    n, psi = rows[0]["n"], rows[0]["psi"]
    t = Table(title=f"ZeRO stages on dp = {n} (Psi = {psi:,} parameters; MiB per rank, the largest rank)")
    for col in ("zero", "params", "grads", "optim", "activ.", "state", "formula", "ratio", "step ms", "sent MiB"):
        t.add_column(col, justify="right")
    for r in rows:
        f = r["formula_bytes"]
        t.add_row(str(r["zero"]), *(f"{r[k] / MIB:.2f}" for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                                  "activations_peak_bytes", "model_state_bytes")),
                  f"{f / MIB:.2f}" if f else "n/a", f"{r['model_state_bytes'] / f:.3f}" if f else "n/a",
                  f"{r['step_time_s'] * 1000:.1f}", f"{r['comm_bytes'] / MIB:.3f}")
    Console(width=120).print(t)
    print("state = params + grads + optim (measured); formula = the ZeRO paper's; ratio = state / formula; "
          "sent = bytes this rank sends per step")


def plot(rows: list[dict], out: Path) -> Path:
    """Left: model state per rank, stacked, with the formula; right: peak activations (a different scale)."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 4), gridspec_kw={"width_ratios": [3, 1.4]})
    stages = [r["zero"] for r in rows]
    bottom = [0.0] * len(rows)
    for key, label in (("params_bytes", "parameters"), ("grads_bytes", "gradients"), ("optimizer_bytes", "optimizer")):
        vals = [r[key] / MIB for r in rows]
        ax.bar(stages, vals, bottom=bottom, label=label, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    formula = [(r["zero"], r["formula_bytes"] / MIB) for r in rows if r["formula_bytes"]]
    if formula:
        ax.plot(*zip(*formula), "k_", ms=36, mew=2, label="ZeRO paper")
    ax.set_xticks(stages, [f"zero={s}" for s in stages])
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"model state per rank, dp = {rows[0]['n']}")
    ax.legend(fontsize=8)
    ax2.bar(stages, [r["activations_peak_bytes"] / MIB for r in rows], color="tab:red", width=0.6)
    ax2.set_xticks(stages, [str(s) for s in stages])
    ax2.set_xlabel("zero")
    ax2.set_title("activations (peak)")
    save(fig, out)
    return out


def bench_memory(base: Config, out: Path, steps: int = 6) -> Path:
    """Run, print the table, write out/memory.json and out/memory.png; returns the PNG's path."""
    rows = run_stages(base, out, steps)
    print_table(rows)
    (out / "memory.json").write_text(json.dumps(rows, indent=1))
    png = plot(rows, out / "memory.png")
    print(f"wrote {out / 'memory.json'} and {png}")
    return png
