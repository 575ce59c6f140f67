"""parallel.auto: the layout chosen at launch for the processes the job has (DeepSpeed's autotuning, DLS ch. 9 ex. 7).

`plait plan` ranks layouts and prints `--set` flags; with parallel.auto = true the launcher applies them: the
fastest layout plait plan's search predicts to fit one device's memory (launch.device_memory, else the
calibration file's, else the datasheet's), among those the job check accepts, for launch.nproc_per_node x nnodes
processes. The choice and its reasons go to the console, config.toml (parallel.auto_reason and the layout keys)
and summary.json; launch.on_resize becomes "replan", and a resume on another process count plans again.
Checkpoints are layout-free, so whatever is chosen trains on the one-process trajectory.
"""

from __future__ import annotations

from dataclasses import replace

from plait.config import Config
from plait.data import build_data
from plait.errors import ConfigError
from plait.parallel.layout import Layout
from plait.plan.cost import PROFILE_PATH, Hardware
from plait.plan.keys import parse_size
from plait.plan.memory import Shape
from plait.plan.replan import apply, describe
from plait.plan.search import plan
from plait.train.job import check_job


def _mb(n: float) -> str:
    return f"{n / 2**20:.3g} MiB"


def optimizer_bytes(cfg: Config) -> int:
    """Bytes of optimizer state per parameter (fp32): AdamW and LAMB two moments, LARS and SGD one momentum buffer
    (none without momentum), 8-bit AdamW two 1-byte moments."""
    o = cfg.optim
    return {"adamw": 8, "lamb": 8, "lars": 4, "adamw8bit": 2}.get(o.name, 4 if o.momentum else 0)


def vocab_size(cfg: Config) -> int:
    """The model's vocabulary: as configured, else the data's (what the model will be built with, and planned for)."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    return build_data(cfg.data, cfg.model).spec.vocab_size


def needs_plan(cfg: Config) -> bool:
    """parallel.auto and no choice yet for this many processes (a new run, or a resume on another count)."""
    if not cfg.parallel.auto:
        return False
    return not cfg.parallel.auto_reason or Layout.from_config(cfg).world_size != processes(cfg)


def processes(cfg: Config) -> int:
    n = cfg.launch.nproc_per_node
    if not isinstance(n, int) or n < 1:
        raise ConfigError("parallel.auto plans for the processes the job has: set launch.nproc_per_node (e.g. --set "
                          "launch.nproc_per_node=4)")
    return n * cfg.max_nodes


def choose(cfg: Config, vocab: int, hw: Hardware | None = None) -> Config:
    """The config at the chosen layout, parallel.auto_reason saying what was chosen and why."""
    if cfg.model.name != "gpt" or cfg.model.factory:
        raise ConfigError(f"parallel.auto plans GPTs (plait plan's model); model.name = {cfg.model.name!r} is not "
                          "one: set the layout yourself (parallel.dp, tp, pp, zero)")
    world = processes(cfg)
    hw = hw or (Hardware.load(PROFILE_PATH) if PROFILE_PATH.is_file() else Hardware())
    if cfg.launch.device_memory:
        hw = replace(hw, memory_bytes=parse_size(cfg.launch.device_memory, "launch.device_memory"))
    preds = plan(Shape.from_config(cfg.model, vocab), world, cfg.train.global_batch_size, hw, optimizer_bytes(cfg))
    plain = sorted((p for p in preds if p["layout"].dp == world and not p["layout"].zero),
                   key=lambda p: p["memory"]["total"])  # data parallel alone, at its smallest
    fitting = [p for p in preds if p["fits"]]
    for p in fitting:  # fastest first
        new = apply(cfg, p["layout"], world)
        try:
            check_job(new)
        except ConfigError:
            continue
        why = (f"plait plan's fastest of the {len(fitting)} layouts of {world} processes that fit "
               f"{_mb(hw.memory_bytes)} per device: {p['time']['step_s'] * 1000:.3g} ms per step and "
               f"{_mb(p['memory']['total'])} per device predicted")
        if plain and not plain[0]["fits"]:
            why += f"; data parallel alone (dp {world}, no ZeRO) would need {_mb(plain[0]['memory']['total'])} at least"
        new.parallel.auto_reason = f"{describe(p['layout'])} ({why})"
        new.launch.on_resize = "replan"
        return new
    least = min(preds, key=lambda p: p["memory"]["total"])
    raise ConfigError(f"parallel.auto: no layout of {world} processes fits {_mb(hw.memory_bytes)} per device (the "
                      f"smallest, {describe(least['layout'])}, needs {_mb(least['memory']['total'])}); raise "
                      "launch.device_memory or launch.nproc_per_node")
