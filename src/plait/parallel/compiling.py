"""torch.compile per block (`train.compile`), after the sharding transforms that change the blocks' modules."""

from __future__ import annotations

import torch.nn as nn

from plait.parallel.base import model_blocks
from plait.parallel.scheme import Build


def apply_compile(model: nn.Module) -> nn.Module:
    """torch.compile each block in place (names unchanged); the whole model if it has no blocks."""
    for block in model_blocks(model) or [model]:
        block.compile()
    return model


def transform(model: nn.Module, b: Build) -> nn.Module:
    return apply_compile(model)
