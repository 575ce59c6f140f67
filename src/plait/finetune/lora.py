"""LoRA (Hu et al. 2021): a frozen Linear plus a trainable low-rank update, y = W x + b + (alpha / r) B A x.

    targets = apply_lora(model, rank=8, alpha=16, targets=["*attn.q", "*attn.v"])  # base frozen, adapters train
    usual_targets(model)          # the family's usual ones, as peft picks them: ["q_proj", "v_proj"] for a Llama
    merge_lora(model)             # plain nn.Linear layers again, W + (alpha / r) B A, the model's own names
    adapter_state_dict(model)     # the adapters alone (name.lora_A, name.lora_B)

`LoRALinear` keeps the wrapped layer's `weight` and `bias` under their own names, so the adapted model's
state_dict is the plain model's plus `<layer>.lora_A` (r x in) and `<layer>.lora_B` (out x r). A is
initialised as nn.Linear initialises a weight (Kaiming-uniform, a = sqrt(5)) and B at zero, so training
starts from the base model's outputs exactly (as peft does).
"""

from __future__ import annotations

import fnmatch
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.errors import ConfigError
from plait.finetune.freezing import match

NF4_BLOCK = 64  # values per absmax scale (QLoRA's first-level block size; the scales are kept in fp32)
# finetune.lora_targets = [] (the default): the attention's query and value projections by the names each family
# gives them, the first set whose every pattern names a Linear layer (peft's defaults per model type): plait's gpt,
# the Llama family (plait's llama; transformers' Llama, Mistral, Qwen2, Mixtral, OPT), BERT, T5, fused projections
USUAL_TARGETS = (("*attn.q", "*attn.v"), ("q_proj", "v_proj"), ("query", "value"), ("q", "v"), ("query_key_value",),
                 ("qkv_proj",), ("Wqkv",))


class LoRALinear(nn.Module):
    """A Linear layer's frozen weight and bias with a rank-r adapter; merge() folds it in, unmerge() takes it out.

    quantize = "nf4" (QLoRA, Dettmers et al. 2023): the frozen weight is stored as 4-bit NormalFloat codes
    (`weight_nf4`, two per byte) and one fp32 absmax per 64 values (`weight_absmax`), through bitsandbytes;
    each forward dequantizes it. Such a layer merges only into a new Linear (`to_linear`).
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, quantize: str = "none"):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        w = base.weight
        self.quantize = quantize
        if quantize == "nf4":
            import bitsandbytes.functional as bnbf  # optional dependency (plait[qlora])

            if w.device.type == "meta":  # shapes only (the job check builds the model on the meta device)
                n = w.numel()
                q = torch.empty((n + 1) // 2, 1, dtype=torch.uint8, device="meta")
                absmax, code = torch.empty(-(-n // NF4_BLOCK), device="meta"), torch.empty(16, device="meta")
            else:
                q, state = bnbf.quantize_4bit(w.detach().float().contiguous(), blocksize=NF4_BLOCK, quant_type="nf4")
                absmax, code = state.absmax.float(), state.code.float()
            if self.in_features % NF4_BLOCK == 0:  # rows of whole blocks: codes and scales by row, as tp splits them
                q = q.view(self.out_features, self.in_features // 2)
                absmax = absmax.view(self.out_features, self.in_features // NF4_BLOCK)
            self.register_buffer("weight_nf4", q)
            self.register_buffer("weight_absmax", absmax)
            self.register_buffer("nf4_code", code.to(absmax.device), persistent=False)  # the 16 NF4 levels
        else:
            self.weight = w
            self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=w.device, dtype=w.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.merged = False
        self.off = False  # the adapter left out of the forward: the base layer (plait.finetune.base_model)

    def base_weight(self) -> torch.Tensor:
        """The frozen weight (dequantized from nf4 when stored so)."""
        if self.quantize != "nf4":
            return self.weight
        codes, absmax = self.weight_nf4, self.weight_absmax
        if hasattr(codes, "device_mesh"):  # a DTensor (tensor parallel): each rank dequantizes its own rows or columns
            from torch.distributed.tensor import DTensor  # here: the module loads without DTensor (serving's start-up)

            local = _dequantize(codes.to_local(), absmax.to_local(), self.nf4_code)
            return DTensor.from_local(local, codes.device_mesh, codes.placements, run_check=False)
        return _dequantize(codes, absmax, self.nf4_code, (self.out_features, self.in_features))

    def packed_weight_numel(self) -> int:
        """Weights held packed in buffers rather than as parameters (the nf4 base): counted with the model's params."""
        return self.out_features * self.in_features if self.quantize == "nf4" else 0

    def base_bytes(self) -> int:
        if self.quantize == "nf4":
            return self.weight_nf4.numel() * self.weight_nf4.element_size() + self.weight_absmax.numel() * 4
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.base_weight()
        y = F.linear(x, w.to(x.dtype) if self.quantize == "nf4" else w, self.bias)
        if self.merged or self.off:
            return y
        return y + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale

    def delta(self) -> torch.Tensor:
        return (self.lora_B @ self.lora_A) * self.scale

    @torch.no_grad()
    def merge(self) -> None:
        if self.quantize == "nf4":
            raise ValueError("an nf4 base cannot take the adapter in place; use to_linear() / merge_lora()")
        if not self.merged:
            self.weight.add_(self.delta().to(self.weight.dtype))
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.weight.sub_(self.delta().to(self.weight.dtype))
            self.merged = False

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear holding W + scale * B A (merges first; an nf4 base is dequantized)."""
        if self.quantize == "nf4":
            w = self.base_weight().float() + (self.delta().float() if not self.merged else 0)
        else:
            self.merge()
            w = self.weight
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=w.device, dtype=self.lora_A.dtype)
        with torch.no_grad():
            out.weight.copy_(w)
            if self.bias is not None:
                out.bias.copy_(self.bias)
        return out

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, alpha={self.alpha}"


def shard_nf4_bases(model: nn.Module) -> int:
    """QLoRA under ZeRO-2/3: every nf4 layer's packed codes and scales become frozen parameters (same names, same
    state-dict keys), so FSDP2 shards them with the rest: at rest a rank holds 1/dp of the base, (n/2 + 4 n/64)/dp
    bytes for n weights, and a unit's whole codes are all-gathered only while it runs, each forward dequantizing its
    own layers (FSDP-QLoRA's layout). Returns how many layers changed."""
    count = 0
    for m in model.modules():
        if isinstance(m, LoRALinear) and m.quantize == "nf4" and "weight_nf4" in m._buffers:
            for name in ("weight_nf4", "weight_absmax"):
                m.register_parameter(name, nn.Parameter(m._buffers.pop(name), requires_grad=False))
            count += 1
    return count


def nf4_storage(model: nn.Module) -> set[int]:
    """ids of the nf4 layers' codes and scales, whether buffers or (under ZeRO-2/3) frozen parameters."""
    return {id(t) for m in model.modules() if isinstance(m, LoRALinear) and m.quantize == "nf4"
            for t in (m.weight_nf4, m.weight_absmax)}


def _dequantize(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, shape: tuple | None = None) -> torch.Tensor:
    """fp32 weights from nf4 codes (two per byte) and one absmax per 64 values; shape: the weight's (default: the codes'
    rows, two columns per byte)."""
    import bitsandbytes.functional as bnbf  # optional dependency (plait[qlora])

    shape = shape or (codes.shape[0], 2 * codes.shape[1])
    state = bnbf.QuantState(absmax=absmax.reshape(-1).float(), shape=torch.Size(shape), code=code, blocksize=NF4_BLOCK,
                            quant_type="nf4", dtype=torch.float32)
    return bnbf.dequantize_4bit(codes.reshape(-1, 1), quant_state=state)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _linears(model: nn.Module, key: str) -> list[str]:
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, LoRALinear)]
    if not linears:
        raise ConfigError(f"{key}: the model has no nn.Linear layer to adapt; set finetune.lora_rank=0")
    return linears


def usual_targets(model: nn.Module, key: str = "finetune.lora_targets") -> list[str]:
    """The patterns LoRA adapts when finetune.lora_targets is empty: the first of USUAL_TARGETS whose every pattern
    names a Linear layer of the model (a pattern without a dot matches the names ending in it)."""
    linears = _linears(model, key)
    for family in USUAL_TARGETS:
        if all(_hits(p, linears) for p in family):
            return list(family)
    raise ConfigError(f"{key} = [] takes the attention's query and value projections by their usual names (q_proj "
                      f"and v_proj, query and value, q and v, ...), and the model has none of them (its Linear layers "
                      f"include {', '.join(linears[:3])}); name the layers to adapt, e.g. "
                      f"finetune.lora_targets=['{linears[0]}']")


def _hits(pattern: str, names: list[str]) -> bool:
    return bool(fnmatch.filter(names, pattern) or ("." not in pattern and fnmatch.filter(names, "*." + pattern)))


def apply_lora(model: nn.Module, rank: int, alpha: float, targets: list[str], key: str = "finetune.lora_targets",
               quantize: str = "none") -> list[str]:
    """Freeze every parameter, then put an adapter on each Linear whose name matches a target (none given: the
    model's usual ones, `usual_targets`); returns their names."""
    linears = _linears(model, key)
    names = match(targets or usual_targets(model, key), linears, key, what="Linear layer")
    owners: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(n)
    for name in names:
        w = model.get_submodule(name).weight
        if len(owners[id(w)]) > 1:
            raise ConfigError(f"{key}: {name}'s weight is shared with {[o for o in owners[id(w)] if not o.startswith(name + '.')]} "
                              "(tied embeddings); merging an adapter would change both: leave it out of the targets or set "
                              "model.tie_embeddings=false")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        _set(model, name, LoRALinear(model.get_submodule(name), rank, alpha, quantize))
    return names


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every LoRALinear with a plain nn.Linear holding the merged weight; the model's own names and shapes."""
    for name, layer in lora_layers(model).items():
        _set(model, name, layer.to_linear())
    return model


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k.endswith((".lora_A", ".lora_B"))}
