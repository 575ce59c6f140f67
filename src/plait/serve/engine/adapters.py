"""Many LoRA adapters over one base model, applied per token without merging (S-LoRA, Punica).

    adapters = [load_adapter("sql", "runs/lora-sql", base), load_adapter("chat", "chat.safetensors", base)]
    router = install_adapters(base, adapters)     # each adapted nn.Linear becomes a MultiLoRALinear
    router.groups = {1: token_rows, 2: ...}       # per forward: which packed tokens take which adapter (engine)

An adapter is a LoRA run directory (its latest checkpoint's `<layer>.lora_A` / `.lora_B`, rank and alpha) or an
adapters-only export (`plait export RUN --adapters-only`, the rank and alpha in its metadata). Each adapted layer
computes the base projection for every token once, then adds scale * B (A x) for the tokens of each adapter
(gathered with index_select, added back with index_add_): requests for different adapters and for the base share
one batch, and a token's output is its adapter's merged model's (W + scale B A) up to float rounding.

A run directory's base weights are checked against the served model's: an adapter trained from other weights
would silently give another model's answers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.export import load_run_checkpoint
from plait.finetune.lora import lora_layers
from plait.serve.errors import ServeError


@dataclass
class Adapter:
    name: str
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer name -> (A (r, in), B (out, r))
    scale: float  # alpha / rank


@dataclass
class LoRARouter:
    """Which packed tokens take which adapter in the forward about to run ({adapter index: token rows}); empty: none."""

    groups: dict[int, torch.Tensor] = field(default_factory=dict)
    count: int = 0  # adapters installed (indices 1..count)
    tokens: int = 0  # the packed tokens the groups index
    selected: dict[int, torch.Tensor] = field(default_factory=dict)  # the groups among the rows the head reads


class MultiLoRALinear(nn.Module):
    """A frozen nn.Linear plus any number of adapters, each applied to its own tokens only."""

    def __init__(self, base: nn.Linear, router: LoRARouter):
        super().__init__()
        self.base, self.router = base, router
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        groups = self.router.groups
        if not groups:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if x2.shape[0] != self.router.tokens:  # the head, after the engine kept only the rows whose logits it reads
            groups = self.router.selected
        for index, rows in groups.items():
            adapter = self.adapters.get(index)
            if adapter is None:
                continue  # this adapter leaves this layer alone
            a, b, scale = adapter
            y2.index_add_(0, rows, F.linear(F.linear(x2.index_select(0, rows), a), b) * scale)
        return y


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def load_adapter(name: str, path: str | Path, base: nn.Module, trust_checkpoint: bool = False) -> Adapter:
    """The adapter at `path` (a LoRA run directory or an adapters-only .safetensors), checked against `base`."""
    path = Path(path)
    where = f"--lora {name}={path}"
    if path.is_dir():
        try:
            _, _, model, _ = load_run_checkpoint(path, trust_checkpoint=trust_checkpoint)
        except Exception as e:
            raise ServeError(f"{where}: {e}") from None
        found = lora_layers(model)
        if not found:
            raise ServeError(f"{where}: the run trained no LoRA adapters (finetune.lora_rank = 0); serve it as a model")
        layers = {n: (m.lora_A.detach().clone(), m.lora_B.detach().clone()) for n, m in found.items()}
        scale = float(next(iter(found.values())).scale)
        for n, m in found.items():
            mine = _linear(base, n, where)
            if m.quantize == "none" and not torch.equal(m.weight.detach().to(mine.weight.device), mine.weight.detach()):
                raise ServeError(f"{where}: its base weights at {n} differ from the served model's; serve the model it "
                                 "was trained from (its train.init_from)")
    elif path.is_file() and path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if "plait.lora" not in meta:
                raise ServeError(f"{where}: not an adapters-only export (no plait.lora metadata); write one with "
                                 "`plait export RUN --adapters-only`")
            lora = json.loads(meta["plait.lora"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        scale = float(lora["alpha"]) / float(lora["rank"])
        layers = {}
        for key in tensors:
            if key.endswith(".lora_A"):
                n = key[:-len(".lora_A")]
                if n + ".lora_B" not in tensors:
                    raise ServeError(f"{where}: {n}.lora_A has no {n}.lora_B")
                layers[n] = (tensors[key], tensors[n + ".lora_B"])
    else:
        raise ServeError(f"{where}: give a LoRA run directory or an adapters-only .safetensors export")
    owners: dict[int, list[str]] = {}
    for pname, param in base.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(pname)
    for n, (a, b) in layers.items():
        mine = _linear(base, n, where)
        others = [o for o in owners.get(id(mine.weight), []) if not o.startswith(n + ".")]
        if others:
            raise ServeError(f"{where}: {n}'s weight is tied to {others[0]}; an adapter there would change both")
        if a.shape[1] != mine.in_features or b.shape[0] != mine.out_features or a.shape[0] != b.shape[1]:
            raise ServeError(f"{where}: {n}'s adapter ({tuple(b.shape)} x {tuple(a.shape)}) does not fit the served "
                             f"layer ({mine.out_features} x {mine.in_features})")
    return Adapter(name, layers, scale)


def _linear(base: nn.Module, name: str, where: str) -> nn.Linear:
    try:
        layer = base.get_submodule(name)
    except AttributeError:
        layer = None
    if isinstance(layer, MultiLoRALinear):
        layer = layer.base
    if not isinstance(layer, nn.Linear):
        raise ServeError(f"{where}: the served model has no Linear layer {name!r} to adapt")
    return layer


def install_adapters(base: nn.Module, adapters: list[Adapter]) -> LoRARouter:
    """Wrap each adapted Linear of `base` (in place); adapter i of the list is index i + 1 (0: the base alone)."""
    router = LoRARouter(count=len(adapters))
    device = next(base.parameters()).device
    for index, adapter in enumerate(adapters, 1):
        for n, (a, b) in adapter.layers.items():
            layer = base.get_submodule(n)
            if not isinstance(layer, MultiLoRALinear):
                layer = MultiLoRALinear(_linear(base, n, adapter.name), router)
                _set(base, n, layer)
            dtype = layer.base.weight.dtype
            layer.adapters[index] = (a.to(device, dtype), b.to(device, dtype), adapter.scale)
    return router
