"""Parallel layouts. `parallelize` is the one place that fixes the order in which schemes are
applied (tensor parallel -> pipeline -> activation checkpointing -> compile -> data parallel);
`build_strategy` returns the Strategy that owns the step for the configured layout."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from plait.parallel.base import Precision, Strategy
from plait.parallel.ddp import DDPStrategy, apply_ddp


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
    """Apply the configured schemes to a plain model in the fixed order; returns what forward runs."""
    if cfg.train.activation_checkpointing:
        model = apply_activation_checkpointing(model)
    if cfg.train.compile:
        model = apply_compile(model)
    if rt.axis_size("dp") > 1:
        model = apply_ddp(model, rt.mesh["dp"], rt.device)
    return model


def build_strategy(module: nn.Module, cfg, rt, make_optimizer: Callable, loss_fn: Callable) -> Strategy:
    """Parallelize the plain module, then build the optimizer over the result and the step owner."""
    model = parallelize(module, cfg, rt)
    optimizer = make_optimizer(module)
    precision = Precision(cfg.precision.dtype, rt.device)
    local_batch = cfg.train.global_batch_size // rt.axis_size("dp")
    cls = DDPStrategy if rt.axis_size("dp") > 1 else Strategy
    return cls(model, module, optimizer, loss_fn, precision, local_batch)


__all__ = ["Precision", "Strategy", "DDPStrategy", "parallelize", "build_strategy", "apply_ddp",
           "apply_activation_checkpointing", "apply_compile"]
