"""The pipeline schedule as it ran: one row per pipeline rank, a box per micro-batch's forward and backward."""

from __future__ import annotations

from pathlib import Path

from plait.report.plots import plt, save


def plot_timeline(per_rank: list[dict], summary: dict, out: Path) -> Path:
    rows: dict[int, dict] = {}
    for r in per_rank:
        rows.setdefault(r["pp_rank"], r)
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.6 * len(rows)))
    t0 = min((e[3] for r in rows.values() for e in r["timeline"]), default=0.0)
    colours = {"F": "tab:blue", "B": "tab:orange"}
    for pp_rank, r in sorted(rows.items()):
        for _stage, kind, mb, start, end in r["timeline"]:
            start, end = start - t0, end - t0
            ax.broken_barh([(start * 1000, (end - start) * 1000)], (pp_rank - 0.4, 0.8), facecolors=colours[kind],
                           edgecolors="white", linewidth=0.5)
            if (end - start) * 1000 > 0:
                ax.text((start + end) / 2 * 1000, pp_rank, f"{kind}{mb}", ha="center", va="center", fontsize=7,
                        color="white")
    ax.set_yticks(sorted(rows), [f"pp rank {k}" for k in sorted(rows)])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first stage began (the run's last step)")
    ax.set_title(f"{summary['schedule']}: {summary['stages']} stages, {summary['microbatches']} micro-batches — "
                 f"bubble {summary['bubble_fraction']:.2f} measured, {summary['bubble_fraction_theory']:.2f} in theory"
                 + (f"\n(+{summary['imbalance_fraction']:.2f} unequal slots, +{summary['fixed_cost_fraction']:.2f} fixed cost: "
                    f"{summary['fixed_cost_ms_per_microbatch']:.2f} ms per micro-batch between slots)"
                    if "fixed_cost_fraction" in summary else ""), fontsize=10)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()], labels=["forward", "backward"],
              loc="lower right", fontsize=8)
    save(fig, out)
    return out
