"""Bottleneck adapters (Houlsby et al. 2019; Pfeiffer et al. 2021): a small trainable MLP on a sublayer's output.

    names = apply_adapters(model, size=16, variant="houlsby")  # base frozen; adapters on attention and MLP outputs
    adapter_layers(model)                                       # {name: AdapterLinear}

Each adapted layer is one of a block's output projections (the attention's and the MLP's: Houlsby, or the MLP's
alone: Pfeiffer), kept with its own `weight` and `bias` and followed by y + up(gelu(down(y))), down: out ->
size, up: size -> out, before the block's residual sum. `up` starts at zero, so training starts from the base
model's outputs exactly. Unlike LoRA an adapter is not linear and cannot be merged into the weights: an export
keeps it as modules (`<layer>.adapter_down.*`, `<layer>.adapter_up.*`, with `plait.adapters` in the metadata
naming the layers and the size), and `--adapters-only` writes those tensors alone.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.errors import ConfigError
from plait.finetune.freezing import match

# the output projections of plait's gpt and llama blocks (what feeds each residual sum)
OUTPUTS = {"houlsby": ("attn.proj", "attn.o_proj", "mlp.down", "mlp.down_proj"),
           "pfeiffer": ("mlp.down", "mlp.down_proj")}


class AdapterLinear(nn.Module):
    """A frozen Linear layer followed by a bottleneck adapter with its residual: y + up(gelu(down(y)))."""

    def __init__(self, base: nn.Linear, size: int):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        for p in (self.weight, self.bias):
            if p is not None:
                p.requires_grad_(False)
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.adapter_down = nn.Linear(self.out_features, size, **kw)
        self.adapter_up = nn.Linear(size, self.out_features, **kw)
        if base.weight.device.type != "meta":
            nn.init.zeros_(self.adapter_up.weight)
            nn.init.zeros_(self.adapter_up.bias)
        self.off = False  # the adapter left out of the forward: the base layer (plait.finetune.base_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.off:
            return y
        return y + self.adapter_up(F.gelu(self.adapter_down(y)))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, size={self.adapter_down.out_features}"


def targets_of(model: nn.Module, spec: dict, key: str = "finetune.adapters") -> list[str]:
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if spec.get("targets"):
        return match(spec["targets"], linears, f"{key}.targets", what="Linear layer")
    ends = OUTPUTS[spec.get("variant", "houlsby")]
    names = [n for n in linears if n.endswith(tuple("." + e for e in ends))]
    if not names:
        raise ConfigError(f"{key}: the model has no block output projection ({', '.join(ends)}) to put an adapter "
                          "after; name the layers with finetune.adapters.targets")
    return names


def apply_adapters(model: nn.Module, size: int, names: list[str]) -> list[str]:
    """Freeze every parameter, then put an adapter after each named Linear layer; returns the names."""
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, AdapterLinear(model.get_submodule(name), size))
    return names


def adapter_layers(model: nn.Module) -> dict[str, AdapterLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, AdapterLinear)}


def adapters_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if ".adapter_down." in k or ".adapter_up." in k}
