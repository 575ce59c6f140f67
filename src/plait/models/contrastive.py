"""An encoder with a projection head, for contrastive training (SimCLR: Chen et al. 2020).

    model = Contrastive(encoder, features=128, projection_dim=32)
    z = model(x)          # x: (batch, 2, *input) two views -> z: (batch, 2, projection_dim)
    h = model.embed(x1)   # x1: (batch, *input) -> the encoder's features, what a linear probe reads

The NT-Xent loss is computed on z (plait.train.loss); downstream tasks use the encoder's
features h, before the projection, as SimCLR does.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class Contrastive(nn.Module):
    def __init__(self, encoder: nn.Module, features: int, projection_dim: int):
        super().__init__()
        self.encoder = encoder
        self.projection = nn.Sequential(nn.Linear(features, features), nn.ReLU(), nn.Linear(features, projection_dim))

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)

    def forward(self, views: torch.Tensor) -> torch.Tensor:
        b = views.shape[0]
        z = self.projection(self.encoder(views.flatten(0, 1)))
        return z.view(b, 2, -1)
