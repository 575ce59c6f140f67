"""Parallel layouts. `parallelize` is the one place that fixes the order in which schemes are
applied (tensor parallel -> pipeline -> activation checkpointing -> compile -> data parallel);
`build_strategy` returns the Strategy that owns the step for the configured layout."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from plait.comm.compression import Compression
from plait.parallel.base import Precision, Strategy
from plait.parallel.ddp import DDPStrategy, apply_ddp
from plait.parallel.embedding import EmbeddingShardStrategy, apply_embedding_sharding
from plait.parallel.fsdp import FSDPStrategy, apply_fsdp
from plait.parallel.gossip import GossipStrategy
from plait.parallel.pipeline import PipelineStrategy
from plait.parallel.ps import PSStrategy, build_ps_strategy
from plait.parallel.split import pipeline_stage, stage_bounds
from plait.parallel.tensor import TensorParallelStrategy
from plait.parallel.tp import apply_tp
from plait.parallel.zero import ZeroOneStrategy


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (`model.blocks`, a ModuleList or ModuleDict), or none."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    return list(blocks) if isinstance(blocks, nn.ModuleList) else []


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each block's activations in backward. Composable: parameter names do not change."""
    from torch.distributed._composable import checkpoint

    blocks = _blocks(model) or [model]
    for block in blocks:
        checkpoint(block)
    return model


def apply_compile(model: nn.Module) -> nn.Module:
    """torch.compile each block in place (names unchanged); the whole model if it has no blocks."""
    blocks = _blocks(model)
    for block in blocks or [model]:
        block.compile()
    return model


def parallelize(model: nn.Module, cfg, rt, data_parallel: bool = True) -> nn.Module:
    """Apply the configured schemes to a plain model (or one pipeline stage) in the fixed order.

    Order: tensor parallel -> activation checkpointing -> compile -> data parallel (DDP, or FSDP2
    for ZeRO-2/3). The pipeline cut happens before this, in build_strategy; ZeRO-1 shards only the
    optimizer and is set up by its strategy; tensor- and pipeline-parallel layouts average their
    gradients over dp by hand (DDP does not take DTensors), so `data_parallel` is False for them.
    """
    if cfg.parallel.tp > 1:
        model = apply_tp(model, rt.mesh["tp"], cfg.parallel.sequence_parallel)
    if cfg.parallel.embedding_sharding != "none":
        model = apply_embedding_sharding(model, cfg.parallel.embedding_sharding, rt.mesh["dp"])
        data_parallel = False  # the dense part's gradients are averaged by the strategy
    if cfg.train.activation_checkpointing:
        model = apply_activation_checkpointing(model)
    if cfg.train.compile:
        model = apply_compile(model)
    dp, zero = rt.axis_size("dp"), cfg.parallel.zero
    if dp > 1 and zero >= 2:
        offload = cfg.parallel.offload != "none" and rt.device.type != "cpu"
        model = apply_fsdp(model, rt.mesh["dp"], zero, param_dtype=cfg.precision.dtype, offload=offload)
    elif dp > 1 and zero == 0 and data_parallel:
        model = apply_ddp(model, rt.mesh["dp"], rt.device, Compression.from_config(cfg.parallel))
    return model


def microbatches(cfg) -> int:
    """Pipeline micro-batches per step: parallel.microbatches, else the accumulation count."""
    return cfg.parallel.microbatches or cfg.grad_accum


def build_strategy(module: nn.Module, cfg, rt, make_optimizer: Callable, loss_fn: Callable) -> Strategy:
    """Parallelize the plain module, then build the optimizer over the result and the step owner.

    make_optimizer(module, only=None) builds the optimizer over module's parameters (or the
    subset whose ids are in `only`).
    """
    if cfg.parallel.offload != "none" and rt.device.type == "cpu" and rt.is_main:
        print(f"note: parallel.offload = {cfg.parallel.offload!r} has no effect on a CPU run (the shards already "
              "live in CPU memory)", flush=True)
    precision = Precision(cfg.precision.dtype, rt.device)
    dp, zero, tp, pp = rt.axis_size("dp"), cfg.parallel.zero, rt.axis_size("tp"), rt.axis_size("pp")
    local_batch = cfg.train.global_batch_size // dp
    if pp > 1:
        v = cfg.parallel.virtual_stages
        bounds = stage_bounds(module, pp * v, cfg.parallel.pp_split or None)
        mine = [rt.axis_rank("pp") + k * pp for k in range(v)]
        parts = [parallelize(pipeline_stage(module, bounds, s), cfg, rt, data_parallel=False) for s in mine]
        tied = module.tied_parameters() if hasattr(module, "tied_parameters") else {}
        return PipelineStrategy(parts, mine, pp * v, rt, make_optimizer, loss_fn, precision, local_batch,
                                microbatches(cfg), cfg.parallel.pp_schedule, module.pipeline_parts()["blocks"], tied,
                                dp_sync=dp > 1)
    if cfg.parallel.sync == "ps":  # the chief worker: the trainer's loader gives it its own slice
        return build_ps_strategy(module, cfg, rt, make_optimizer, loss_fn, precision, whole_batches=False)
    if cfg.parallel.sync == "gossip":
        model = parallelize(module, cfg, rt, data_parallel=False)
        return GossipStrategy(model, module, make_optimizer(module), loss_fn, precision, local_batch, rt.axis_group("dp"),
                              cfg.parallel.gossip_every, cfg.parallel.gossip_topology)
    model = parallelize(module, cfg, rt, data_parallel=tp == 1)
    if cfg.parallel.embedding_sharding != "none":
        return EmbeddingShardStrategy(model, module, make_optimizer(module), loss_fn, precision, local_batch, rt=rt,
                                      mode=cfg.parallel.embedding_sharding)
    if dp > 1 and zero == 1:
        return ZeroOneStrategy(module, make_optimizer, loss_fn, precision, local_batch, rt.axis_group("dp"))
    optimizer = make_optimizer(module)
    if dp > 1 and zero >= 2:
        # FSDP2 casts parameters itself (its mixed-precision policy); autocast would be redundant.
        fsdp_precision = Precision("fp32", rt.device) if cfg.precision.dtype == "bf16" else precision
        return FSDPStrategy(model, module, optimizer, loss_fn, fsdp_precision, local_batch, stage=zero,
                            dp_group=rt.axis_group("dp"), tensor_parallel=tp > 1)
    if tp > 1:
        return TensorParallelStrategy(model, module, optimizer, loss_fn, precision, local_batch, rt=rt)
    cls = DDPStrategy if dp > 1 else Strategy
    return cls(model, module, optimizer, loss_fn, precision, local_batch)


__all__ = ["Precision", "Strategy", "DDPStrategy", "FSDPStrategy", "ZeroOneStrategy", "PipelineStrategy",
           "TensorParallelStrategy", "GossipStrategy", "PSStrategy", "parallelize", "build_strategy", "apply_ddp",
           "apply_fsdp", "apply_tp", "apply_activation_checkpointing", "apply_compile"]
