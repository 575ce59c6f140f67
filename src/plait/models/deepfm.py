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
from plait.models.protocols import megatron_plan


class EmbeddingCollection(nn.Module):
    """One table per field; forward maps ids (batch, fields) to (batch, fields, k + 1)."""

    def __init__(self, cardinalities: list[int], dim: int):
        super().__init__()
        self.tables = nn.ModuleDict({str(i): nn.Embedding(c, dim) for i, c in enumerate(cardinalities)})
        for t in self.tables.values():
            nn.init.normal_(t.weight, std=0.05)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.tables[str(i)](ids[:, i]) for i in range(ids.shape[1])], 1)


class FMInteraction(nn.Module):
    """The FM's pairwise term, sum over pairs i < j of <v_i, v_j>, as 0.5 * ((sum v)^2 - sum v^2) over latent dims.

    Its own module (no parameters) so that tensor parallel can split it: each tp rank takes a slice of the latent
    dimensions and the slices' sums are added (DeepFM.tp_plan)."""

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(-1)


class DeepFM(nn.Module):
    """Pipeline cut points: the MLP's layers are the blocks; the first stage also holds the embeddings, the FM and
    the first-order parts, and passes (MLP activations, FM logit) on: two tensors between stages."""

    def __init__(self, cardinalities: list[int], dense: int, k: int, width: int, depth: int, dropout: float = 0.0):
        super().__init__()
        self.fields, self.k = len(cardinalities), k
        self.cardinalities = list(cardinalities)
        self.embed = EmbeddingCollection(cardinalities, k + 1)
        self.fm = FMInteraction()
        layers, d_in = [], self.fields * k + dense
        for _ in range(depth):
            layers += [nn.Linear(d_in, width), nn.ReLU(), nn.Dropout(dropout)]
            d_in = width
        self.mlp = nn.Sequential(*layers, nn.Linear(d_in, 1))
        self.head = str(len(self.mlp) - 1)  # the MLP's output layer: the stage holding it returns the logit
        self.dense_linear = nn.Linear(dense, 1) if dense else None
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, fm: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.embed is not None:  # the whole model, or the first pipeline stage: x is the raw rows
            ids, dense = x[:, :self.fields].long(), x[:, self.fields:]
            e = self.embed(ids)
            v = e[..., 1:]
            fm = self.bias + e[..., 0].sum(1) + self.fm(v)
            if self.dense_linear is not None:
                fm = fm + self.dense_linear(dense).squeeze(-1)
            x = torch.cat([v.flatten(1), dense], 1)
        assert fm is not None, "a later pipeline stage receives (activations, FM logit)"
        h = self.mlp(x)
        if self.head in self.mlp._modules:
            return fm + h.squeeze(-1)
        return h, fm

    def pipeline_parts(self) -> dict:
        return {"blocks": "mlp", "first": ["embed", "fm", "dense_linear", "bias"], "last": []}

    def tp_plan(self, sequence_parallel: bool) -> dict:
        """Megatron's split of the MLP (column- then row-parallel pairs) and the FM over latent dimensions: each tp
        rank's slice of v (a local slice forward; the gradient all-gathered), its partial pairwise sums all-reduced."""
        from torch.distributed.tensor import Partial, Replicate, Shard
        from torch.distributed.tensor.parallel import PrepareModuleInputOutput

        if sequence_parallel:
            raise ConfigError("deepfm has no sequence to shard; set parallel.sequence_parallel=false")
        plan = megatron_plan(self)  # on a pipeline stage: the pairs among the layers it holds
        if self.fm is not None:
            plan["fm"] = PrepareModuleInputOutput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(-1),), use_local_input=True,
                output_layouts=(Partial(),), desired_output_layouts=(Replicate(),), use_local_output=True)
        return plan

    def tp_check(self, tp: int) -> None:  # the MLP's split matrices are checked with the plan (check_tp_plan)
        if self.fm is not None and self.k % tp:
            raise ConfigError(f"parallel.tp = {tp} splits deepfm's FM over the latent dimensions, model.embedding_dim = "
                              f"{self.k}; make it a multiple of {tp}")


def build_deepfm(cfg, spec: DataSpec) -> DeepFM:
    if not spec.cardinalities:
        raise ConfigError(f"model.name = 'deepfm' needs categorical data (data.name = 'clicks'); got {spec.name!r}")
    return DeepFM(spec.cardinalities, spec.dense_features, cfg.embedding_dim, cfg.width, cfg.depth, cfg.dropout)
