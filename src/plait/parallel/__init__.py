"""Parallel layouts. `parallelize` is the one place that fixes the order in which schemes are
applied (tensor parallel -> pipeline -> activation checkpointing -> compile -> data parallel);
`build_strategy` returns the Strategy that owns the step for the configured layout."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from plait.parallel.base import Precision, Strategy
from plait.parallel.ddp import DDPStrategy, apply_ddp
from plait.parallel.fsdp import FSDPStrategy, apply_fsdp
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


def parallelize(model: nn.Module, cfg, rt) -> nn.Module:
    """Apply the configured schemes to a plain model in the fixed order; returns what forward runs.

    Order: activation checkpointing -> compile -> data parallel (DDP, or FSDP2 for ZeRO-2/3;
    ZeRO-1 shards only the optimizer and is set up by its strategy).
    """
    if cfg.train.activation_checkpointing:
        model = apply_activation_checkpointing(model)
    if cfg.train.compile:
        model = apply_compile(model)
    dp, zero = rt.axis_size("dp"), cfg.parallel.zero
    if dp > 1 and zero >= 2:
        offload = cfg.parallel.offload != "none" and rt.device.type != "cpu"
        model = apply_fsdp(model, rt.mesh["dp"], zero, param_dtype=cfg.precision.dtype, offload=offload)
    elif dp > 1 and zero == 0:
        model = apply_ddp(model, rt.mesh["dp"], rt.device)
    return model


def build_strategy(module: nn.Module, cfg, rt, make_optimizer: Callable, loss_fn: Callable) -> Strategy:
    """Parallelize the plain module, then build the optimizer over the result and the step owner.

    make_optimizer(module, only=None) builds the optimizer over module's parameters (or the
    subset whose ids are in `only`).
    """
    if cfg.parallel.offload != "none" and rt.device.type == "cpu" and rt.is_main:
        print(f"note: parallel.offload = {cfg.parallel.offload!r} has no effect on a CPU run (the shards already "
              "live in CPU memory)", flush=True)
    model = parallelize(module, cfg, rt)
    precision = Precision(cfg.precision.dtype, rt.device)
    dp, zero = rt.axis_size("dp"), cfg.parallel.zero
    local_batch = cfg.train.global_batch_size // dp
    if dp > 1 and zero == 1:
        return ZeroOneStrategy(module, make_optimizer, loss_fn, precision, local_batch, rt.axis_group("dp"))
    optimizer = make_optimizer(module)
    if dp > 1 and zero >= 2:
        # FSDP2 casts parameters itself (its mixed-precision policy); autocast would be redundant.
        return FSDPStrategy(model, module, optimizer, loss_fn, Precision("fp32", rt.device) if cfg.precision.dtype == "bf16"
                            else precision, local_batch, stage=zero, dp_group=rt.axis_group("dp"))
    cls = DDPStrategy if dp > 1 else Strategy
    return cls(model, module, optimizer, loss_fn, precision, local_batch)


__all__ = ["Precision", "Strategy", "DDPStrategy", "FSDPStrategy", "ZeroOneStrategy", "parallelize", "build_strategy",
           "apply_ddp", "apply_fsdp",
           "apply_activation_checkpointing", "apply_compile"]
