"""A multi-layer perceptron classifier over flattened inputs."""

from __future__ import annotations

import math

import torch.nn as nn

from plait.data.spec import DataSpec


class MLP(nn.Module):
    def __init__(self, in_features: int, width: int, depth: int, classes: int, dropout: float = 0.0):
        super().__init__()
        dims = [in_features] + [width] * depth
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Dropout(dropout)) for a, b in zip(dims[:-1], dims[1:])
        )
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, x):
        x = x.flatten(1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_mlp(cfg, spec: DataSpec) -> MLP:
    return MLP(math.prod(spec.input_shape), cfg.width, cfg.depth, spec.num_classes, cfg.dropout)
