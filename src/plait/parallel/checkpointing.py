"""Activation checkpointing (`train.activation_checkpointing`): each block's activations recomputed in backward."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed._composable import checkpoint

from plait.parallel.base import model_blocks
from plait.parallel.scheme import Build


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each block's activations in backward. Composable: parameter names do not change."""
    for block in model_blocks(model) or [model]:
        checkpoint(block)
    return model


def transform(model: nn.Module, b: Build) -> nn.Module:
    return apply_activation_checkpointing(model)
