"""Optimizers and the learning-rate schedule (a pure function of the step, so resuming needs only the step)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def param_groups(model: nn.Module, weight_decay: float, only: set[int] | None = None) -> list[dict]:
    """Matrices and embeddings decay; biases and norm scales do not. `only`: ids of the parameters to include."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad and (only is None or id(p) in only):
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": ps, "weight_decay": wd} for ps, wd in ((decay, weight_decay), (no_decay, 0.0)) if ps]
    if not groups:
        raise ValueError("no trainable parameters to optimize")
    return groups


def build_optimizer(model: nn.Module, optim_cfg, only: set[int] | None = None) -> torch.optim.Optimizer:
    """The configured optimizer over the model's parameters (or the subset `only`, by id)."""
    groups = param_groups(model, optim_cfg.weight_decay, only)
    if optim_cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps)
    return torch.optim.SGD(groups, lr=optim_cfg.lr, momentum=optim_cfg.momentum)


def lr_at(step: int, optim_cfg, total_steps: int) -> float:
    """Linear warmup to lr over warmup_steps, then cosine decay to min_lr_ratio * lr at total_steps."""
    peak = optim_cfg.lr
    if optim_cfg.warmup_steps and step < optim_cfg.warmup_steps:
        return peak * (step + 1) / optim_cfg.warmup_steps
    if optim_cfg.schedule == "constant":
        return peak
    span = max(1, total_steps - optim_cfg.warmup_steps)
    progress = min(1.0, (step - optim_cfg.warmup_steps) / span)
    floor = peak * optim_cfg.min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
