"""`plait plan` and `plait simulate`: which layout to run, and how it scales, before the job starts.

    plait plan [CONFIG] --devices N [--device-memory 80GB] [--device-flops 989e12]
               [--link-bandwidth 400Gbps,25Gbps] [--devices-per-node 8] [--top 10] [--out DIR]
    plait plan [CONFIG] --calibrate [--world 2]       # measure this machine; later plans use it
    plait simulate [CONFIG] --devices 1024 [--set-layout tp=8,pp=1] [...hardware flags]
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from plait.config import load_config
from plait.errors import ConfigError

UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_size(text: str, what: str) -> float:
    """'80GB' -> 80e9 bytes, '16GiB' -> 16 * 2**30."""
    m = re.fullmatch(r"\s*([\d.]+(?:e\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise ConfigError(f"{what} = {text!r} is not a size; write e.g. 80GB or 16GiB")
    return float(m.group(1)) * UNITS[m.group(2) or ""]


def parse_rate(text: str, what: str) -> float:
    """'400Gbps' -> bytes per second (bits / 8); '50GB/s' -> bytes per second."""
    m = re.fullmatch(r"\s*([\d.]+(?:e\d+)?)\s*([kmgt]?)(bps|b/s|bit/s)\s*", text, re.IGNORECASE)
    if not m:
        raise ConfigError(f"{what} = {text!r} is not a rate; write e.g. 400Gbps (bits) or 50GB/s (bytes)")
    value = float(m.group(1)) * UNITS[m.group(2).lower()]
    return value if m.group(3) in ("B/s",) else value / 8


def hardware(a):
    from plait.plan.cost import PROFILE_PATH, Hardware  # lazily: plait --help must not import torch

    hw = Hardware.load(Path(a.profile)) if a.profile else (Hardware.load() if PROFILE_PATH.is_file() and not any(
        (a.device_memory, a.device_flops, a.link_bandwidth)) else Hardware())
    if a.device_memory:
        hw.memory_bytes = parse_size(a.device_memory, "--device-memory")
    if a.device_flops:
        hw.flops = float(a.device_flops)
    if a.link_bandwidth:
        parts = a.link_bandwidth.split(",")
        hw.intra_bw = parse_rate(parts[0], "--link-bandwidth")
        hw.inter_bw = parse_rate(parts[-1], "--link-bandwidth")
        hw.comm = {}
    if a.devices_per_node:
        hw.devices_per_node = a.devices_per_node
    return hw


def _model(a):
    # lazily: plait --help must not import torch
    from plait.data import build_data
    from plait.plan.memory import Shape

    cfg = load_config(a.config, a.set, validate=False)
    if cfg.model.name != "gpt" or cfg.model.factory:
        raise ConfigError(f"plait plan models GPTs; model.name = {cfg.model.name!r} is not one")
    vocab = cfg.model.vocab_size
    if not vocab:
        vocab = build_data(cfg.data, cfg.model).spec.vocab_size
    return cfg, Shape.from_config(cfg.model, vocab)


def cmd_plan(a) -> int:
    from rich.console import Console
    from rich.table import Table

    # lazily: plait --help must not import torch or matplotlib
    from plait.plan.calibrate import calibrate
    from plait.plan.search import explain_no_fit, plan, plot, table

    cfg, shape = _model(a)
    if a.calibrate:
        with Console(stderr=True).status(f"calibrating {a.world} local processes: matmuls, the model, collectives, "
                                         "sharded layers, the optimizer (a minute or two) ..."):
            hw = calibrate(cfg.model, shape.vocab, cfg.train.micro_batch_size, a.world)
        path = hw.save(Path(a.profile)) if a.profile else hw.save()
        print(f"{hw.name}: {hw.flops / 1e9:.1f} GFLOP/s per process (fp32 matmul), model efficiency "
              f"{hw.efficiency:.2f}, optimizer {hw.optimizer_s_per_param * 1e9:.2f} ns/parameter")
        for op, f in sorted(hw.comm.items()):
            print(f"  {op:18} latency {f['latency_s'] * 1e6:8.1f} us   bandwidth {f['bw'] / 1e9:6.2f} GB/s")
        over = hw.layer_overhead_s
        if over:
            print(f"  fixed cost per layer: tensor parallel {over['tp'][0] * 1e3:.2f} ms + {over['tp'][1] * 1e3:.3f} ms "
                  f"per sample (with sequence parallel {over['tp_sp'][0] * 1e3:.2f} ms + {over['tp_sp'][1] * 1e3:.3f}); "
                  f"fully_shard {over['fsdp'] * 1e3:.2f} ms per step")
        print(f"wrote {path}; `plait plan` uses it from now on")
        return 0
    if not a.devices:
        raise ConfigError("plait plan needs --devices N (or --calibrate)")
    hw = hardware(a)
    gb = cfg.train.global_batch_size
    preds = plan(shape, a.devices, gb, hw)
    if not preds[0]["fits"]:
        raise ConfigError(explain_no_fit(shape, a.devices, gb, hw, preds))
    fitting = [p for p in preds if p["fits"]]
    t = Table(title=f"{shape.params / 1e6:.1f}M-parameter GPT, global batch {gb}, {a.devices} devices ({hw.name}); "
                    f"{len(fitting)} of {len(preds)} layouts fit {hw.memory_bytes / 1e9:.1f} GB")
    for col in ("layout", "GB/device", "step ms", "compute", "comm", "bubble", "MFU %", "fits"):
        t.add_column(col, justify="right" if col != "layout" else "left")
    for row in table(fitting, a.top):
        t.add_row(*row)
    Console(width=140).print(t)
    best = fitting[0]["layout"]
    print(f"best: {best.label()} -> plait train {a.config or ''} {best.sets()}".replace("  ", " "))
    out = Path(a.out) if a.out else Path("runs") / f"plan-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    print(f"wrote {plot(fitting, out / 'plan.png', a.top)}")
    return 0


def cmd_simulate(a) -> int:
    from plait.plan.simulate import plot_scaling, scaling  # lazily: plait --help must not import torch or matplotlib

    cfg, shape = _model(a)
    hw = hardware(a)
    fixed = dict(kv.split("=") for kv in a.layout.split(",")) if a.layout else {}
    rows = scaling(shape, cfg.train.global_batch_size, hw, a.devices, {k: int(v) for k, v in fixed.items()},
                   weak=a.weak)
    print(f"{'devices':>8} {'layout':32} {'step ms':>10} {'MFU %':>7} {'scaling eff. %':>15}")
    for r in rows:
        print(f"{r['devices']:>8} {r['layout']:32} {r['step_s'] * 1000:>10.1f} {r['mfu'] * 100:>7.1f} "
              f"{r['efficiency'] * 100:>15.1f}")
    out = Path(a.out) if a.out else Path("runs") / f"simulate-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    print(f"wrote {plot_scaling(rows, out / 'scaling.png')}")
    return 0


def _hardware_flags(p) -> None:
    p.add_argument("--device-memory", help="memory per device, e.g. 80GB")
    p.add_argument("--device-flops", help="peak FLOP/s per device in the training dtype, e.g. 989e12")
    p.add_argument("--link-bandwidth", help="inside a node,across nodes, e.g. 400Gbps,25Gbps")
    p.add_argument("--devices-per-node", type=int)
    p.add_argument("--profile", help="device profile JSON (default: ~/.cache/plait/device_profile.json if calibrated)")
    p.add_argument("--out", help="where the PNG goes (default: runs/plan-<time>)")


def add_parsers(sub, bench) -> None:
    p = sub.add_parser("plan", help="rank every layout for N devices by predicted step time and memory")
    p.add_argument("config", nargs="?")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--devices", type=int)
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--calibrate", action="store_true", help="measure this machine and store a device profile")
    p.add_argument("--world", type=int, default=2, help="--calibrate: local processes to measure")
    _hardware_flags(p)
    p.set_defaults(fn=cmd_plan)
    s = sub.add_parser("simulate", help="project step time, MFU and scaling efficiency up to many devices")
    s.add_argument("config", nargs="?")
    s.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    s.add_argument("--devices", type=int, required=True, help="the largest device count")
    s.add_argument("--layout", help="fix the model-parallel part, e.g. tp=8,pp=1 (default: the best at each size)")
    s.add_argument("--weak", action="store_true", help="grow the global batch with the data-parallel degree")
    _hardware_flags(s)
    s.set_defaults(fn=cmd_simulate)
