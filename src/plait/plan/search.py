"""Every layout plait can run on N devices, predicted, filtered by memory and ranked by step time."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from plait.config import Config
from plait.errors import ConfigError
from plait.parallel import check_config
from plait.parallel.layout import Layout
from plait.plan.cost import Hardware, predict
from plait.plan.memory import Shape
from plait.report.plots import plt, save

GB = 1e9


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def supported(lay: Layout, shape: Shape, global_batch: int) -> bool:
    """Whether plait's schemes accept this layout (asked of the schemes' own checks, as `plait train` would)."""
    return refusal(lay, shape, global_batch) is None


def refusal(lay: Layout, shape: Shape, global_batch: int) -> str | None:
    """Why `plait train` would refuse this layout (the schemes' own message), or None when it runs it."""
    cfg = Config()
    cfg.model.layers, cfg.model.heads = shape.layers, shape.heads
    if shape.moe_layers:
        cfg.model.moe_experts, cfg.model.moe_top_k = shape.experts, shape.top_k
        cfg.model.moe_every = shape.layers // shape.moe_layers
    p = cfg.parallel
    p.dp, p.tp, p.pp, p.zero, p.sequence_parallel = lay.dp, lay.tp, lay.pp, lay.zero, lay.sequence_parallel
    p.pp_schedule, p.virtual_stages, p.ep, p.cp = lay.schedule, lay.virtual_stages, lay.ep, lay.cp
    cfg.train.global_batch_size, cfg.train.micro_batch_size = global_batch, lay.micro_batch
    cfg.train.activation_checkpointing = lay.activation_checkpointing
    try:
        check_config(cfg)
    except ConfigError as e:
        return str(e)
    return None


def layouts(shape: Shape, devices: int, global_batch: int) -> list[Layout]:
    """The layouts plait's schemes support for this model, device count and global batch."""
    out = []
    for tp in _divisors(devices):
        if shape.heads % tp or shape.vocab % tp:
            continue
        for pp, cp in _pp_cp(shape, devices // tp):
            dp = devices // (tp * pp * cp)
            if global_batch % dp:
                continue
            local = global_batch // dp
            for micro in [m for m in _divisors(local) if m <= 64]:
                schedules = [("1f1b", 1)] if pp == 1 else [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)]
                for zero in ((0,) if dp * cp == 1 else (0, 1, 2, 3)):
                    for schedule, virtual in schedules:
                        # expert parallel: every degree that divides dp and the experts (the checks say which)
                        for ep in [k for k in _divisors(dp) if shape.experts % k == 0] if shape.experts else [1]:
                            lay = Layout(dp, tp, pp, zero, micro, schedule, virtual, ep=ep, cp=cp)
                            if not supported(lay, shape, global_batch):
                                continue
                            for ac in (False, True):
                                for sp in ((False, True) if tp > 1 else (False,)):
                                    out.append(replace(lay, activation_checkpointing=ac, sequence_parallel=sp))
    return out


def _pp_cp(shape: Shape, devices: int) -> list[tuple[int, int]]:
    """(pp, cp) pairs of the devices left after tp: pipeline stages or (without them) context-parallel groups, whose
    degree cuts each sequence into 2 cp equal chunks."""
    out = []
    for pp in _divisors(devices):
        if pp > shape.layers:
            continue
        out += [(pp, cp) for cp in _divisors(devices // pp) if cp == 1 or (pp == 1 and shape.context % (2 * cp) == 0)]
    return out


def plan(shape: Shape, devices: int, global_batch: int, hw: Hardware, optimizer_k: int = 8) -> list[dict]:
    """Predictions for every layout, fitting ones first, fastest first."""
    preds = [predict(shape, lay, global_batch, hw, optimizer_k) for lay in layouts(shape, devices, global_batch)]
    if not preds:
        raise ConfigError(f"no layout of {devices} devices divides the global batch ({global_batch}) and the model; "
                          "change --devices or train.global_batch_size")
    preds.sort(key=lambda p: (not p["fits"], p["time"]["step_s"], p["memory"]["total"]))
    return preds


def plan_up_to(shape: Shape, devices: int, global_batch: int, hw: Hardware, optimizer_k: int = 8) -> list[dict]:
    """plan() over every device count that divides `devices` (each prediction's layout says how many it uses):
    a model too small for all of them runs fastest on a few, and the ranking says so."""
    preds = []
    for n in _divisors(devices):
        try:
            preds += plan(shape, n, global_batch, hw, optimizer_k)
        except ConfigError:
            continue
    if not preds:
        plan(shape, devices, global_batch, hw, optimizer_k)  # raises, naming the device count asked for
    preds.sort(key=lambda p: (not p["fits"], round(p["time"]["step_s"], 12), p["layout"].devices,
                              p["memory"]["total"]))
    return preds


def smallest_fit(shape: Shape, devices: int, global_batch: int, hw: Hardware, limit: int = 1 << 16) -> int | None:
    """The smallest device count, doubling from `devices`, on which some layout fits."""
    n = devices
    while n < limit:
        n *= 2
        try:
            if any(p["fits"] for p in plan(shape, n, global_batch, hw)):
                return n
        except ConfigError:
            continue
    return None


def explain_no_fit(shape: Shape, devices: int, global_batch: int, hw: Hardware, preds: list[dict]) -> str:
    best = min(preds, key=lambda p: p["memory"]["total"])
    need = best["memory"]["total"]
    n = smallest_fit(shape, devices, global_batch, hw)
    where = f"the smallest device count that fits: {n}" if n else "no device count up to 65536 fits"
    return (f"the model does not fit on {devices} devices of {hw.memory_bytes / GB:.1f} GB: the leanest layout "
            f"({best['layout'].label()}) needs {need / GB:.2f} GB per device, {(need - hw.memory_bytes) / GB:.2f} GB "
            f"too much; {where}")


COLUMNS = ("layout", "devices", "GB/device", "step ms", "compute ms", "comm ms", "bubble ms", "MFU %", "fits")


def percent(fraction: float) -> str:
    """A share in %: one decimal, or two significant digits below 1 % (a tiny model's MFU is not 0.0)."""
    value = fraction * 100
    return f"{value:.1f}" if value >= 1 or value == 0 else f"{value:.2g}"


def table(preds: list[dict], top: int = 10) -> list[list[str]]:
    """Rows under COLUMNS."""
    rows = []
    for p in preds[:top]:
        t, m = p["time"], p["memory"]
        comm = t["dp_exposed_s"] + t["tp_comm_s"] + t["pp_comm_s"] + t["ep_comm_s"]
        rows.append([p["layout"].label(), str(p["layout"].devices), f"{m['total'] / GB:.3f}",
                     f"{t['step_s'] * 1000:.2f}", f"{t['compute_s'] * 1000:.2f}", f"{comm * 1000:.2f}",
                     f"{t['bubble_s'] * 1000:.2f}", percent(t["mfu"]), "yes" if p["fits"] else "NO"])
    return rows


def plot(preds: list[dict], out: Path, top: int = 10) -> Path:
    chosen = preds[:top]
    labels = [p["layout"].label() for p in chosen]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 0.5 * len(chosen) + 1.5), sharey=True)
    left = [0.0] * len(chosen)
    for key, name in (("compute_s", "compute"), ("tp_comm_s", "tensor-parallel comm"), ("pp_comm_s", "pipeline comm"),
                      ("ep_comm_s", "expert all-to-all"),
                      ("bubble_s", "bubble"), ("dp_exposed_s", "exposed dp comm"), ("optimizer_s", "optimizer")):
        vals = [p["time"][key] * 1000 for p in chosen]
        ax.barh(labels, vals, left=left, label=name)
        left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.set_xlabel("predicted ms per step")
    ax.legend(fontsize=7)
    ax2.barh(labels, [p["memory"]["total"] / GB for p in chosen], color="tab:gray")
    ax2.set_xlabel("GB per device")
    save(fig, out)
    return out


__all__ = ["layouts", "plan", "plan_up_to", "refusal", "explain_no_fit", "table", "plot", "replace", "smallest_fit"]
