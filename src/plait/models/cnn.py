"""A small convolutional classifier for image-shaped inputs (channels, height, width).

GroupNorm, not BatchNorm: per-sample normalisation keeps the trajectory independent
of how the global batch is split into micro-batches and ranks."""

from __future__ import annotations

import torch.nn as nn

from plait.data.spec import DataSpec
from plait.errors import ConfigError
from plait.models.patchgd import PatchCNN


class CNN(nn.Module):
    def __init__(self, in_channels: int, width: int, depth: int, classes: int, dropout: float = 0.0):
        super().__init__()
        chans = [in_channels] + [width] * depth
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.GroupNorm(1, b), nn.ReLU())
            for a, b in zip(chans[:-1], chans[1:])
        )
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(chans[-1], classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.drop(x.mean(dim=(2, 3))))


def build_cnn(cfg, spec: DataSpec) -> CNN:
    if len(spec.input_shape) != 3:
        raise ConfigError(
            f"model.name = 'cnn' needs image-shaped samples (channels, height, width); data.name = "
            f"{spec.name!r} gives samples of shape {tuple(spec.input_shape)}; use model.name = 'mlp'"
        )
    if cfg.patch_size:
        return _patch_cnn(cfg, spec)
    return CNN(spec.input_shape[0], cfg.width, cfg.depth, spec.num_classes, cfg.dropout)


def _patch_cnn(cfg, spec: DataSpec) -> nn.Module:
    c, h, w = spec.input_shape
    p = cfg.patch_size
    if h % p or w % p:
        raise ConfigError(f"model.patch_size = {p} must divide the images' height and width ({h} x {w}); choose a "
                          f"divisor such as {next(d for d in range(min(p, h, w), 0, -1) if h % d == 0 and w % d == 0)}")
    count = (h // p) * (w // p)
    if cfg.patch_grad > count:
        raise ConfigError(f"model.patch_grad = {cfg.patch_grad}: a {h} x {w} image has {count} patches of {p} x {p}; "
                          f"choose at most {count} (0: every patch)")
    return PatchCNN(c, cfg.width, cfg.depth, spec.num_classes, p, cfg.patch_grad or count, cfg.dropout)
