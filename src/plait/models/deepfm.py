"""DeepFM (Guo et al., 2017) for click-through prediction: a factorization machine and an MLP sharing embeddings.

Inputs are rows of categorical ids (one per field) followed by dense features. Every field has
an embedding table of width k + 1: column 0 is the field's first-order weight, columns 1..k its
latent vector. The logit is bias + first order + the FM's pairwise term + the MLP's output.
The tables live in `embed.tables` (one per field, keyed by field index), so that a model-parallel
layout can hold some of them (or some rows of each) and keep the plain parameter names.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from plait.data.spec import DataSpec
from plait.errors import ConfigError


class EmbeddingCollection(nn.Module):
    """One table per field; forward maps ids (batch, fields) to (batch, fields, k + 1)."""

    def __init__(self, cardinalities: list[int], dim: int):
        super().__init__()
        self.tables = nn.ModuleDict({str(i): nn.Embedding(c, dim) for i, c in enumerate(cardinalities)})
        for t in self.tables.values():
            nn.init.normal_(t.weight, std=0.05)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.tables[str(i)](ids[:, i]) for i in range(ids.shape[1])], 1)


class DeepFM(nn.Module):
    def __init__(self, cardinalities: list[int], dense: int, k: int, width: int, depth: int, dropout: float = 0.0):
        super().__init__()
        self.fields, self.k = len(cardinalities), k
        self.cardinalities = list(cardinalities)
        self.embed = EmbeddingCollection(cardinalities, k + 1)
        layers, d_in = [], self.fields * k + dense
        for _ in range(depth):
            layers += [nn.Linear(d_in, width), nn.ReLU(), nn.Dropout(dropout)]
            d_in = width
        self.mlp = nn.Sequential(*layers, nn.Linear(d_in, 1))
        self.dense_linear = nn.Linear(dense, 1) if dense else None
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, dense = x[:, :self.fields].long(), x[:, self.fields:]
        e = self.embed(ids)
        first, v = e[..., 0].sum(1), e[..., 1:]
        pairwise = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(-1)
        deep = self.mlp(torch.cat([v.flatten(1), dense], 1)).squeeze(-1)
        out = self.bias + first + pairwise + deep
        if self.dense_linear is not None:
            out = out + self.dense_linear(dense).squeeze(-1)
        return out


def build_deepfm(cfg, spec: DataSpec) -> DeepFM:
    if not spec.cardinalities:
        raise ConfigError(f"model.name = 'deepfm' needs categorical data (data.name = 'clicks'); got {spec.name!r}")
    return DeepFM(spec.cardinalities, spec.dense_features, cfg.embedding_dim, cfg.width, cfg.depth, cfg.dropout)
