"""Losses by task; each is a mean over the micro-batch's samples (lm: over its tokens)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from plait.data.spec import DataSpec


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets)


def binary_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits.reshape(-1).float(), targets.reshape(-1).float())


def loss_for(spec: DataSpec) -> Callable:
    return {"lm": lm_loss, "classification": classification_loss, "binary": binary_loss}[spec.task]
