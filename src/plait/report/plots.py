"""Matplotlib figures of a run (PNG files, headless backend).

`plt` is matplotlib.pyplot imported on first use (with the Agg backend): the ranks, the workers and the planner import
this module's users and most of them draw nothing, so they import it at the top and pay for matplotlib (0.3-0.5 s)
only when they plot.
"""

from __future__ import annotations

from pathlib import Path

from plait.report.bottleneck import row_split


class _Pyplot:
    """matplotlib.pyplot, imported headless when an attribute of it is first read."""

    def __getattr__(self, name: str):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot

        return getattr(matplotlib.pyplot, name)


plt = _Pyplot()


def save(fig, out: Path) -> Path:
    """Lay out, write as PNG and free the figure (every plait plot ends here)."""
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def loss_curve(metrics: list[dict], out: Path, baseline: float | None = None) -> Path | None:
    train = [(m["step"], m["loss"]) for m in metrics if "loss" in m]
    val = [(m["step"], m["val_loss"]) for m in metrics if "val_loss" in m]
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train), label="train loss", lw=1.5)
    if val:
        ax.plot(*zip(*val), "o", label="validation loss", ms=6)
    if baseline is not None:
        ax.axhline(baseline, ls="--", c="gray", label=f"unigram baseline ({baseline:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, out)
    return out


COLOURS = {"data": "C2", "compute": "C0", "exposed_comm": "C3", "bubble": "C1", "optimizer": "C4",
           "other": "lightgray"}
LABELS = {"exposed_comm": "communication (exposed)", "bubble": "pipeline bubble"}


def step_time_breakdown(metrics: list[dict], out: Path, bubble_fraction: float = 0.0) -> Path | None:
    """Stacked bars: mean ms per step in each category of the bottleneck report (data, compute, exposed
    communication, pipeline bubble, optimizer, other), per logging window. The first window holds start-up (the
    first step's allocation, compilation, ...) and is left out when there are others, as the report's figures do."""
    rows = [m for m in metrics if "time" in m and "step_time_s" in m]
    if not rows:
        return None
    warm_up = rows[0]["step"] if len(rows) > 1 else None
    rows = rows[1:] if len(rows) > 1 else rows
    splits = [row_split(m, bubble_fraction) for m in rows]
    steps = [m["step"] for m in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(rows)
    width = max(1.0, (steps[-1] - steps[0]) / max(1, len(steps)) * 0.8) if len(steps) > 1 else 0.8
    for part, colour in COLOURS.items():
        vals = [sp[part] * 1000 for sp in splits]
        if any(vals) or part in ("compute", "exposed_comm"):
            ax.bar(steps, vals, width=width, bottom=bottom, label=LABELS.get(part, part), color=colour)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("step")
    ax.set_ylabel("ms per step")
    ax.set_title("where each step's time goes"
                 + (f" (warm-up window to step {warm_up} left out)" if warm_up is not None else ""), fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    save(fig, out)
    return out


def freeze_points(metrics: list[dict], out: Path) -> Path | None:
    """Step time over the steps with each block's freeze (finetune.progressive_freeze) marked where it happened."""
    events = [m for m in metrics if "froze" in m]
    rows = [(m["step"], m["step_time_s"] * 1000) for m in metrics if "step_time_s" in m]
    if not events or not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*rows), lw=1.5, label="step time")
    for i, e in enumerate(events):
        ax.axvline(e["step"], ls="--", c="C3", lw=1, label="a block frozen" if i == 0 else None)
        ax.annotate(e["froze"], (e["step"], 1), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                    ha="right", va="top", xytext=(-2, -2), textcoords="offset points")
    ax.set_xlabel("step")
    ax.set_ylabel("ms per step")
    ax.set_ylim(bottom=0)
    ax.set_title("progressive freezing: step time as the blocks freeze")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, out)
    return out


def expert_load(metrics: list[dict], out: Path, max_layers: int = 4) -> Path | None:
    """Each expert's share of its MoE layer's routed tokens over the steps (one panel per layer, the first few),
    against the uniform share 1/E; the share of dropped assignments, if any, on the first panel."""
    rows = [m for m in metrics if m.get("moe_tokens_per_expert")]
    if not rows:
        return None
    layers = min(max_layers, len(rows[0]["moe_tokens_per_expert"]))
    steps = [m["step"] for m in rows]
    fig, axes = plt.subplots(1, layers, figsize=(4 * layers, 3.5), squeeze=False, sharey=True)
    for i, ax in enumerate(axes[0]):
        loads = [m["moe_tokens_per_expert"][i] for m in rows]
        experts = len(loads[0])
        for e in range(experts):
            ax.plot(steps, [row[e] / max(1e-12, sum(row)) for row in loads], lw=1, label=f"expert {e}")
        ax.axhline(1 / experts, ls="--", c="gray", lw=1)
        if i == 0 and any(m.get("moe_dropped") for m in rows):
            ax.plot(steps, [m.get("moe_dropped", 0.0) for m in rows], c="black", lw=1.5, label="dropped share")
        ax.set_title(f"MoE layer {i}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("share of routed tokens")
    if len(axes[0][0].get_lines()) <= 17:
        axes[0][0].legend(fontsize=7)
    save(fig, out)
    return out


def preference_rewards(metrics: list[dict], out: Path) -> Path | None:
    """Preference tuning (train.objective = dpo, ipo, simpo): the implicit rewards of the chosen and rejected
    completions and their margin over the steps (training windows; validation as points), and the share of pairs
    ranked right on a second axis."""
    rows = [m for m in metrics if "reward_margin" in m]
    if not rows:
        return None
    steps = [m["step"] for m in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [m["reward_margin"] for m in rows], lw=2, c="C0", label="margin (chosen - rejected)")
    ax.plot(steps, [m["reward_chosen"] for m in rows], lw=1, c="C2", label="chosen reward")
    ax.plot(steps, [m["reward_rejected"] for m in rows], lw=1, c="C3", label="rejected reward")
    val = [(m["step"], m["val_reward_margin"]) for m in metrics if "val_reward_margin" in m]
    if val:
        ax.plot(*zip(*val), "o", c="C0", ms=6, label="validation margin")
    ax.axhline(0, c="gray", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("implicit reward")
    ax.grid(alpha=0.3)
    acc = ax.twinx()
    acc.plot(steps, [m["reward_accuracy"] for m in rows], ls="--", c="C1", lw=1, label="pairs ranked right")
    acc.set_ylim(0, 1.05)
    acc.set_ylabel("share of pairs ranked right", color="C1")
    lines = [line for line in ax.get_lines() + acc.get_lines() if not line.get_label().startswith("_")]  # not y = 0
    ax.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="upper left")
    ax.set_title("preference tuning: the rewards of chosen and rejected completions")
    save(fig, out)
    return out


def training_curves(metrics: list[dict], out: Path) -> Path | None:
    """Four panels over the steps: train and validation loss, learning rate, gradient norm, throughput."""
    rows = [m for m in metrics if "loss" in m and "step" in m]
    if not rows:
        return None
    rate = "tokens_per_s" if any("tokens_per_s" in m for m in rows) else "samples_per_s"
    panels = [("loss", "loss (nats)"), ("lr", "learning rate"), ("grad_norm", "gradient norm (before clipping)"),
              (rate, rate.replace("_per_s", " / s"))]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    for ax, (key, label) in zip(axes.flat, panels):
        pts = [(m["step"], m[key]) for m in rows if isinstance(m.get(key), (int, float))]
        if pts:
            ax.plot(*zip(*pts), lw=1.5, label="train" if key == "loss" else None)
        if key == "loss":
            val = [(m["step"], m["val_loss"]) for m in metrics if "val_loss" in m and "step" in m]
            if val:
                ax.plot(*zip(*val), "o-", ms=4, label="validation")
            ax.legend(fontsize=8)
        if not pts:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    save(fig, out)
    return out


def compare_curves(runs: dict[str, list[dict]], out: Path) -> Path | None:
    """Train and validation loss of several runs, overlaid (one colour per run)."""
    if not any(any("loss" in m for m in ms) for ms in runs.values()):
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, ms) in enumerate(runs.items()):
        c = f"C{i % 10}"
        train = [(m["step"], m["loss"]) for m in ms if "loss" in m and "step" in m]
        val = [(m["step"], m["val_loss"]) for m in ms if "val_loss" in m and "step" in m]
        if train:
            a.plot(*zip(*train), c=c, lw=1.3, label=name)
        if val:
            b.plot(*zip(*val), "o-", c=c, ms=4, label=name)
    for ax, title in ((a, "train loss"), (b, "validation loss")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, out)
    return out
