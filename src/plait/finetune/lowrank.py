"""Low-rank factorisation of Linear layers (truncated SVD), for `plait compress --low-rank`.

    ranks = {"blocks.0.mlp.up": 8, ...}
    factorise(model, ranks)            # W (out x in) ~ (U_r sqrt(S_r)) (sqrt(S_r) V_r^T): two smaller layers
    with_low_rank_structure(model, ranks)   # the same structure, uninitialised, to load a compressed file into

A factorised layer is `LowRankLinear` with `<layer>.down.weight` (r x in) and `<layer>.up.weight` (out x r) plus
`<layer>.up.bias`; it keeps in_features / out_features so code that reads them (a GPT's head_dim) still works.
Its parameters are r (in + out) (+ out) against in * out (+ out), and so are its FLOPs per token.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class LowRankLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.down = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.up = nn.Linear(rank, out_features, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))

    @classmethod
    @torch.no_grad()
    def from_linear(cls, layer: nn.Linear, rank: int) -> LowRankLinear:
        w = layer.weight.detach().double()
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        root = s[:rank].sqrt()
        out = cls(layer.in_features, layer.out_features, rank, layer.bias is not None, layer.weight.device, layer.weight.dtype)
        out.down.weight.copy_(root[:, None] * vh[:rank])
        out.up.weight.copy_(u[:, :rank] * root[None, :])
        if layer.bias is not None:
            out.up.bias.copy_(layer.bias)
        return out


def energy_rank(weight: torch.Tensor, energy: float) -> int:
    """The smallest r whose singular values keep `energy` of the squared Frobenius norm."""
    s = torch.linalg.svdvals(weight.detach().double())
    kept = torch.cumsum(s * s, 0) / (s * s).sum()
    return int(torch.searchsorted(kept, torch.tensor(energy, dtype=kept.dtype)).item()) + 1


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def factorise(model: nn.Module, ranks: dict[str, int]) -> nn.Module:
    for name, r in ranks.items():
        _set(model, name, LowRankLinear.from_linear(model.get_submodule(name), r))
    return model


def with_low_rank_structure(model: nn.Module, ranks: dict[str, int]) -> nn.Module:
    for name, r in ranks.items():
        old = model.get_submodule(name)
        _set(model, name, LowRankLinear(old.in_features, old.out_features, r, old.bias is not None))
    return model
