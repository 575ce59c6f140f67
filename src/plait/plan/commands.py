"""What `plait plan` and `plait simulate` do (their parsers: plait.plan.cli): the hardware the flags describe, the
model's shape, the ranked layouts and the scaling table. Imported when one of them runs.

The calibration file's path and the calibration are read from their modules when a verb runs (cost.PROFILE_PATH,
calibrate.calibrate), not bound here: a test points them elsewhere.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from plait.config import load_config
from plait.data import build_data
from plait.errors import ConfigError
from plait.plan import calibrate, cost
from plait.plan.keys import parse_rate, parse_size
from plait.plan.memory import Shape
from plait.plan.search import COLUMNS, explain_no_fit, percent, plan, plan_up_to, plot, table
from plait.plan.simulate import plot_scaling, scaling
from plait.rundir import timestamped


def hardware(a):
    """The Hardware the flags describe, and in words where its figures come from (which profile file, if any)."""
    flags = [f for f, v in (("--device-memory", a.device_memory), ("--device-flops", a.device_flops),
                            ("--link-bandwidth", a.link_bandwidth), ("--devices-per-node", a.devices_per_node)) if v]
    if a.profile:
        hw, source = cost.Hardware.load(Path(a.profile)), f"the profile {a.profile} (--profile)"
    elif cost.PROFILE_PATH.is_file() and not any((a.device_memory, a.device_flops, a.link_bandwidth)):
        hw = cost.Hardware.load(cost.PROFILE_PATH)
        source = (f"the calibration file {cost.PROFILE_PATH} (written by `plait plan --calibrate`; --profile FILE "
                  "or the hardware flags choose other figures)")
    else:
        hw = cost.Hardware()
        source = ("datasheet figures (80 GB, 989 TFLOP/s, 400 Gbps in a node, 25 Gbps across; no calibration file "
                  "is used)")
    if flags:
        source += f", with {', '.join(flags)} as given"
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
    return hw, f"hardware: {source}"


def _model(a):
    cfg = load_config(a.config, a.set, validate=False)
    if cfg.model.name != "gpt" or cfg.model.factory:
        raise ConfigError(f"plait plan models GPTs; model.name = {cfg.model.name!r} is not one")
    vocab = cfg.model.vocab_size
    if not vocab:
        vocab = build_data(cfg.data, cfg.model).spec.vocab_size
    return cfg, Shape.from_config(cfg.model, vocab)


def cmd_plan(a) -> int:
    cfg, shape = _model(a)
    if a.calibrate:
        with Console(stderr=True).status(f"calibrating {a.world} local processes: matmuls, the model, collectives, "
                                         "sharded layers, the optimizer (a minute or two) ..."):
            hw = calibrate.calibrate(cfg.model, shape.vocab, cfg.train.micro_batch_size, a.world)
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
        if a.profile:
            print(f"wrote the calibration file {path}; `plait plan` and `plait simulate` use it with --profile {path}")
        else:
            print(f"wrote the calibration file {path}; `plait plan` and `plait simulate` use it from now on (they say "
                  f"so; --profile FILE picks another, delete {path} to go back to datasheet figures)")
        return 0
    hw, source = hardware(a)
    if not a.devices:
        if not hw.name.startswith("calibrated"):
            raise ConfigError("plait plan needs --devices N (or --calibrate first: then it plans for the processes it "
                              "measured)")
        a.devices = hw.devices_per_node  # the machine calibrated: plan for what it measured
        source += f"; planning for its {a.devices} processes (--devices N plans for more)"
    print(source)
    gb = cfg.train.global_batch_size
    whole = plan(shape, a.devices, gb, hw)
    if not whole[0]["fits"]:
        raise ConfigError(explain_no_fit(shape, a.devices, gb, hw, whole))
    preds = plan_up_to(shape, a.devices, gb, hw)  # all of them, or fewer where a small model runs faster on fewer
    fitting = [p for p in preds if p["fits"]]
    t = Table(title=f"{shape.params / 1e6:.1f}M-parameter GPT, global batch {gb}, up to {a.devices} devices "
                    f"({hw.name}); {len(fitting)} of {len(preds)} layouts fit {hw.memory_bytes / 1e9:.1f} GB")
    for col in COLUMNS:
        t.add_column(col, justify="right" if col != "layout" else "left")
    for row in table(fitting, a.top):
        t.add_row(*row)
    Console(width=160).print(t)
    best = fitting[0]
    lay = best["layout"]
    if lay.devices < a.devices:
        full = next(p for p in whole if p["fits"])
        print(f"a {shape.params / 1e6:.1f}M-parameter model runs fastest on {lay.devices} of the {a.devices} devices: "
              f"{best['time']['step_s'] * 1e3:.2f} ms per step (MFU {percent(best['time']['mfu'])} %) against "
              f"{full['time']['step_s'] * 1e3:.2f} ms (MFU {percent(full['time']['mfu'])} %) for the best layout of all "
              f"{a.devices} ({full['layout'].label()}): more devices only add communication")
    print(f"best: {lay.label()} on {lay.devices} device{'s' * (lay.devices > 1)} -> plait train {a.config or ''} "
          f"{lay.sets()}".replace("  ", " "))
    out = Path(a.out) if a.out else timestamped("plan")
    out.mkdir(parents=True, exist_ok=True)
    print(f"wrote {plot(fitting, out / 'plan.png', a.top)}")
    return 0


def cmd_simulate(a) -> int:
    cfg, shape = _model(a)
    hw, source = hardware(a)
    print(source)
    fixed = _fixed_layout(a.layout)
    gb = cfg.train.global_batch_size
    rows = scaling(shape, gb, hw, a.devices, fixed, weak=a.weak)
    print(f"{'devices':>8} {'layout':32} {'global batch':>12} {'step ms':>10} {'MFU %':>7} {'scaling eff. %':>15}")
    refused = []
    for r in rows:
        if "refused" in r:
            refused.append(r)
            what = "plait train refuses this layout (below)" if fixed else "no layout plait train runs (below)"
            print(f"{r['devices']:>8} {r['layout']:32} {r['global_batch']:>12} {what:>34}")
            continue
        print(f"{r['devices']:>8} {r['layout']:32} {r['global_batch']:>12} {r['step_s'] * 1000:>10.2f} "
              f"{percent(r['mfu']):>7} {percent(r['efficiency']):>15}")
    if refused:  # the same rule refuses them all: the first one's reason
        first = refused[0]
        print(f"{first['devices']} devices" + (f" ({first['layout']})" if fixed else "") + f": {first['refused']}")
    if not a.weak and any("global_batch_size" in r["refused"] or "global batch" in r["refused"] for r in refused):
        print(f"{len(refused)} device count(s) have no layout plait train runs with the global batch of {gb}: "
              "--weak grows the batch with the data-parallel degree, or raise train.global_batch_size")
    out = Path(a.out) if a.out else timestamped("simulate")
    out.mkdir(parents=True, exist_ok=True)
    print(f"wrote {plot_scaling(rows, out / 'scaling.png')}")
    return 0


def _fixed_layout(text: str | None) -> dict:
    """--layout tp=8,pp=1 -> {"tp": 8, "pp": 1}."""
    keys = ("tp", "pp", "zero", "micro", "ac")
    out = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, _, value = part.partition("=")
        if key.strip() not in keys or not value.strip().isdigit():
            raise ConfigError(f"--layout {text!r}: write KEY=N pairs separated by commas with KEY one of "
                              f"{', '.join(keys)}, e.g. --layout tp=8,pp=1")
        out[key.strip()] = int(value)
    return out
