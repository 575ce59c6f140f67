"""Pipeline parallel (plait.parallel.pipeline): its keys against the layout, and the cut points it asks of the model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.errors import ConfigError
from plait.models.keys import CAPABILITIES
from plait.parallel.keys import PipelineKeys
from plait.parallel.layout import Layout
from plait.parallel.scheme import Scheme

if TYPE_CHECKING:
    import torch.nn as nn


def check(layout: Layout, keys: PipelineKeys) -> None:
    """What the layout asks of the pipeline's keys (the keys' own rules are PipelineKeys.check)."""
    p = layout.pp
    if keys.pp_schedule == "interleaved-1f1b" and p > 1 and keys.virtual_stages < 2:
        raise ConfigError("parallel.pp_schedule = 'interleaved-1f1b' needs parallel.virtual_stages >= 2 model "
                          "chunks per pipeline rank; set --set parallel.virtual_stages=2")
    if isinstance(keys.pp_split, list) and keys.pp_split and p > 1 and len(keys.pp_split) != layout.stages - 1:
        raise ConfigError(
            f"parallel.pp_split = {keys.pp_split} gives {len(keys.pp_split) + 1} stages but the layout has "
            f"{layout.stages}; give {layout.stages - 1} block indices")
    if p == 1:
        return
    if keys.microbatches and layout.global_batch % (layout.dp * keys.microbatches):
        raise ConfigError(
            f"train.global_batch_size ({layout.global_batch}) must be divisible by parallel.dp ({layout.dp}) * "
            f"parallel.microbatches ({keys.microbatches}) = {layout.dp * keys.microbatches}")
    m = layout.pipeline_microbatches
    if keys.pp_schedule == "interleaved-1f1b" and m % p:
        raise ConfigError(
            f"parallel.pp_schedule = 'interleaved-1f1b' needs the micro-batches per step ({m}) to be a multiple "
            f"of parallel.pp ({p}); set parallel.microbatches={p * max(1, m // p)}")


def check_model(layout: Layout, keys: PipelineKeys, model_cfg, model: nn.Module | None) -> None:
    """The model can be cut into pp * virtual_stages stages (model None: the registered model model_cfg names)."""
    if layout.ep > 1:
        raise ConfigError(f"parallel.ep = {layout.ep} with parallel.pp = {layout.pp}: expert parallel's all-to-alls do "
                          "not run inside pipeline stages in this version; set parallel.ep=1 (the experts stay whole "
                          "in their stage) or parallel.pp=1")
    stages = layout.stages
    if model is None:
        if "pipeline" not in CAPABILITIES.get(model_cfg.name, frozenset()):
            raise ConfigError(
                f"parallel.pp = {layout.pp} cuts the model into stages, but model.name = {model_cfg.name!r} has no "
                "pipeline cut points (an nn.Sequential, or a `pipeline_parts()` method naming its blocks, see "
                "docs/models.md); set parallel.pp=1")
        if model_cfg.name == "gpt" and stages > model_cfg.layers:
            raise ConfigError(
                f"parallel.pp ({layout.pp}) * parallel.virtual_stages ({layout.virtual_stages}) = {stages} "
                f"stages but model.layers = {model_cfg.layers}: every stage needs a block; lower pp or raise layers")
        return
    from plait.models.protocols import is_transformers_model, pipeline_blocks  # only for a model object (torch)

    what = model_cfg.factory or type(model).__name__
    blocks = pipeline_blocks(model)
    if blocks is None and is_transformers_model(model):
        raise ConfigError(
            f"parallel.pp = {layout.pp} cuts the model into stages, but {what} ({type(model).__name__}) declares no "
            "pipeline plan plait can cut (a _pp_plan with an embedding taking input_ids, a ModuleList of layers, "
            "and the rest); set parallel.pp=1")
    if blocks is None:
        raise ConfigError(
            f"parallel.pp = {layout.pp} cuts the model into stages, but {what}"
            f"{f' ({type(model).__name__})' if model_cfg.factory else ''} is no nn.Sequential and has no "
            "`pipeline_parts()` naming its blocks (docs/models.md); set parallel.pp=1")
    if stages > len(blocks):
        raise ConfigError(
            f"parallel.pp ({layout.pp}) * parallel.virtual_stages ({layout.virtual_stages}) = {stages} stages but {what} "
            f"has {len(blocks)} block(s) to cut between: every stage needs one; set parallel.pp={max(1, len(blocks))} "
            "or lower")
    if keys.pp_split == "auto" and model_cfg.factory:
        raise ConfigError("parallel.pp_split = 'auto' times plait's GPT blocks; for your own model give the cut "
                          "points (parallel.pp_split = [i, ...]) or leave it empty (balanced by parameters)")
    if isinstance(keys.pp_split, list) and keys.pp_split and not all(0 < i < len(blocks) for i in keys.pp_split):
        raise ConfigError(f"parallel.pp_split = {keys.pp_split}: {what} has {len(blocks)} blocks; give block indices "
                          f"strictly between 0 and {len(blocks)}")


SCHEME = Scheme("pipeline", applies=lambda layout, keys: layout.pp > 1, keys=PipelineKeys, check=check,
                check_model=check_model, strategy="plait.parallel.pipeline:build")
