"""Adaptive model parallelism: a new layout for a job whose world size changed (launch.on_resize = "replan").

An elastic job that lost or gained processes keeps its layout's tensor and pipeline degrees and adapts data
parallelism (launch.on_resize = "dp", the default). When tp x pp no longer divides the new world size, or the
global batch no longer divides, `replan` asks `plait plan`'s search for the layouts of the new world size and takes
the fastest one predicted to fit memory, preferring the job's own micro-batch size, activation checkpointing and
sequence parallelism. Checkpoints are layout-free, so the job resumes at the new layout on the same trajectory.

Every rank decides alone, before any process group exists, so the decision must be the same everywhere: it
depends on the config, the world size, the vocabulary and the hardware figures, which are the calibration file
(`plait plan --calibrate`, ~/.cache/plait/device_profile.json) when there is one, else the planner's datasheet figures.
Nodes that do not share a home directory should share the calibration file, or have none.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from plait.config import Config
from plait.errors import ConfigError
from plait.parallel.layout import Layout
from plait.plan.cost import PROFILE_PATH, Hardware
from plait.plan.memory import Shape
from plait.plan.search import plan
from plait.train.job import check_job


def layout_of(cfg: Config) -> Layout:
    p, t = cfg.parallel, cfg.train
    return Layout(p.dp, p.tp, p.pp, p.zero, t.micro_batch_size, p.pp_schedule, p.virtual_stages,
                  t.activation_checkpointing, p.sequence_parallel, p.ep, cp=p.cp)


def describe(lay: Layout) -> str:
    text = f"dp {lay.dp} x tp {lay.tp} x pp {lay.pp}" + (f" x cp {lay.cp}" if lay.cp > 1 else "")
    if lay.zero:
        text += f", ZeRO-{lay.zero}"
    if lay.pp > 1:
        text += f", {lay.schedule}" + (f" x {lay.virtual_stages} virtual stages" if lay.virtual_stages > 1 else "")
    return text + f", micro-batch {lay.micro_batch}"


def apply(cfg: Config, lay: Layout, world: int) -> Config:
    new = copy.deepcopy(cfg)
    p, t = new.parallel, new.train
    p.dp, p.tp, p.pp, p.zero, p.ep, p.cp = lay.dp, lay.tp, lay.pp, lay.zero, lay.ep, lay.cp
    p.pp_schedule, p.virtual_stages, p.sequence_parallel = lay.schedule, lay.virtual_stages, lay.sequence_parallel
    t.micro_batch_size, t.activation_checkpointing = lay.micro_batch, lay.activation_checkpointing
    if lay.dp == 1:
        p.offload, p.embedding_sharding = "none", "none"
    new.launch.nnodes, new.launch.nproc_per_node, new.launch.node_rank = "1", world, 0
    return new


def replan(cfg: Config, world: int, vocab: int, hw: Hardware | None = None) -> tuple[Config, str]:
    """(the config at the chosen layout, a sentence saying what was chosen and from what)."""
    if cfg.model.name != "gpt" or cfg.model.factory:
        raise ConfigError(f"launch.on_resize = 'replan' plans GPTs (plait plan's model); model.name = "
                          f"{cfg.model.name!r} is not one: use launch.on_resize = 'dp'")
    hw = hw or (Hardware.load(PROFILE_PATH) if PROFILE_PATH.is_file() else Hardware())
    old = layout_of(cfg)
    preds = [p for p in plan(Shape.from_config(cfg.model, vocab), world, cfg.train.global_batch_size, hw) if p["fits"]]
    # the job's own choices first (they do not change the trajectory, but the user made them), then the fastest
    preds.sort(key=lambda p: (replace(p["layout"], dp=1, tp=1, pp=1, zero=0, schedule="1f1b", virtual_stages=1, ep=1)
                              != replace(old, dp=1, tp=1, pp=1, zero=0, schedule="1f1b", virtual_stages=1, ep=1),
                              p["time"]["step_s"]))
    for p in preds:
        new = apply(cfg, p["layout"], world)
        try:
            check_job(new)
        except ConfigError:
            continue
        return new, (f"{describe(p['layout'])} (plait plan's fastest fitting layout of {world} processes: "
                     f"{p['time']['step_s'] * 1000:.3g} ms per step predicted, {len(preds)} candidates)")
    raise ConfigError(f"the job now has {world} processes and no layout of them fits the model in memory "
                      f"(launch.on_resize = 'replan'); it cannot continue at this size")
