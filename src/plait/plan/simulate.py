"""`plait simulate`: the cost model projected from a few devices to thousands.

For each device count (doubling up to --devices) the layout is either the planner's best or a
fixed model-parallel part (tp, pp) with data parallel making up the rest. Scaling efficiency is
weak-scaling efficiency against one device running the same work at the profile's efficiency
with no communication: (model FLOP/s per device at N) / (FLOP/s of one device), the measure
Megatron-LM reports against its single-GPU baseline.
"""

from __future__ import annotations

from pathlib import Path

from plait.config import ModelConfig
from plait.errors import ConfigError
from plait.parallel.layout import Layout
from plait.plan.cost import Hardware, model_flops, predict, predict_time
from plait.plan.memory import Shape
from plait.plan.search import plan, refusal
from plait.report.plots import plt, save


def scaling(shape: Shape, global_batch: int, hw: Hardware, max_devices: int, fixed: dict | None = None,
            weak: bool = False, elem: int = 4, check: bool = True) -> list[dict]:
    """One row per device count; a row with "refused" (the reason) where `plait train` would not run the layout.

    check=False skips plait's own layout checks (a paper's setting plait does not run, e.g. Megatron-LM's model).
    """
    fixed = fixed or {}
    mp = fixed.get("tp", 1) * fixed.get("pp", 1)
    n = max(8, mp)
    counts = []
    while n <= max_devices:
        counts.append(n)
        n *= 2
    if not counts or counts[-1] != max_devices:
        counts.append(max_devices)
    base_dp = counts[0] // mp
    rows = []
    for n in counts:
        gb = global_batch * (n // mp) // base_dp if weak else global_batch
        if fixed:
            dp = n // mp
            lay = Layout(dp=dp, tp=fixed.get("tp", 1), pp=fixed.get("pp", 1), zero=fixed.get("zero", 0),
                         micro_batch=fixed.get("micro", max(1, gb // dp)), schedule="1f1b",
                         activation_checkpointing=bool(fixed.get("ac", 0)))
            why = refusal(lay, shape, gb) if check else None
            if why:  # `plait train` would refuse it: no figures for a layout that cannot run
                rows.append({"devices": n, "layout": lay.label(), "global_batch": gb, "refused": why})
                continue
            pred = predict(shape, lay, gb, hw)
            pred["time"] = _with_elem(shape, lay, gb, hw, elem)
        else:
            try:
                pred = plan(shape, n, gb, hw)[0]
            except ConfigError as e:
                rows.append({"devices": n, "layout": "-", "global_batch": gb, "refused": str(e)})
                continue
        t = pred["time"]
        achieved = model_flops(shape, gb) / t["step_s"] / n
        rows.append({"devices": n, "layout": pred["layout"].label(), "global_batch": gb, "step_s": t["step_s"],
                     "mfu": t["mfu"], "efficiency": achieved / (hw.flops * hw.efficiency), "fits": pred["fits"]})
    return rows


def _with_elem(shape, lay, gb, hw, elem):
    return predict_time(shape, lay, gb, hw, elem)


def megatron_2019() -> tuple[Shape, Hardware, dict, int]:
    """Megatron-LM (Shoeybi et al., 2019), 8.3B GPT-2 on 512 V100s with 8-way tensor parallel.

    Model: 72 layers, hidden 3072, 32 heads, sequence 1024, vocabulary 51,200 (padded), untied
    head counted in the matmuls. Machines: DGX-2H, 16 V100 per node (NVSwitch, 150 GB/s each way
    per GPU), 8 x 100 Gb/s InfiniBand per node (6.25 GB/s per GPU across nodes). Peak 125 TFLOP/s
    fp16; efficiency 0.312 = their single-GPU baseline (39 TFLOP/s on a 1.2B model). Weak scaling:
    8 sequences per model-parallel group, 512 in all at 64-way data parallel; fp16 gradients and
    activations; gradient all-reduce after backward, half of it hidden behind it. Reported: 77 %
    scaling efficiency (15.1 PFLOP/s).
    """
    cfg = ModelConfig(layers=72, heads=32, width=3072, context=1024, vocab_size=51200, tie_embeddings=False)
    shape = Shape.from_config(cfg, 51200)
    hw = Hardware(name="Megatron-LM 2019: DGX-2H V100", memory_bytes=32e9, flops=125e12, efficiency=39 / 125,
                  intra_bw=150e9, inter_bw=100e9 / 8 / 2, latency_s=10e-6, devices_per_node=16, overlap=0.5,
                  optimizer_s_per_param=1e-11)
    return shape, hw, {"tp": 8, "pp": 1, "micro": 8}, 512


def plot_scaling(rows: list[dict], out: Path) -> Path:
    rows = [r for r in rows if "refused" not in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r["devices"] for r in rows]
    ax.plot(xs, [r["efficiency"] * 100 for r in rows], "o-", label="scaling efficiency")
    ax.plot(xs, [r["mfu"] * 100 for r in rows], "s--", label="MFU")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices")
    ax.set_ylabel("%")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, out)
    return out
