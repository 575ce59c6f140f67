"""Fine-tuning transforms on the plain model, applied before any parallel scheme wraps it (docs/finetune.md;
plait.finetune re-exports them).

    apply_finetune(model, cfg.finetune)   # [finetune] freeze patterns, then LoRA adapters
    check(cfg)                            # the section's rules and the layouts it is tested with

Both act on the plain model's names and on `requires_grad`, so every scheme that builds its gradient
synchronisation and optimizer from the parameters that require a gradient (DDP, ZeRO-1, FSDP2 for
ZeRO-2/3) sends, stores and updates only what trains.
"""

from __future__ import annotations

import contextlib

import torch.nn as nn

from plait.errors import ConfigError
from plait.finetune.adapters import AdapterLinear, adapter_layers, adapters_state_dict, apply_adapters, targets_of
from plait.finetune.freezing import freeze, trainable_params
from plait.finetune.lora import LoRALinear, adapter_state_dict, apply_lora, lora_layers, merge_lora
from plait.finetune.progressive import ProgressiveFreeze, freeze_steps


def active(cfg) -> bool:
    f = cfg.finetune
    return bool(f.freeze) or f.lora_rank > 0 or f.progressive_freeze or bool(f.adapters)


def check_layout(cfg, layout) -> None:
    """The layouts freezing, LoRA and progressive freezing are tested with: data, tensor, pipeline (not progressive),
    context and expert parallel and ZeRO 1-3 (the keys' own rules are
    plait.finetune.keys'). Under ZeRO-2/3 a QLoRA base's 4-bit codes and scales are sharded with the rest
    (plait.finetune.lora.shard_nf4_bases); under ZeRO-1 each rank holds them whole (an eighth of fp32)."""
    f = cfg.finetune
    # a fixed finetune.freeze only turns requires_grad off: tensor parallel's DTensors take it as they are; a LoRA
    # layer splits its adapter as its weight is split (plait.finetune.lora.tp_styles)
    tp_ok = not f.adapters  # an nf4 base splits along its blocks (plait.finetune.lora.tp_styles checks them)
    sharded_ok = layout.sync == "allreduce" and layout.embedding_sharding == "none"
    if active(cfg) and not sharded_ok:
        raise ConfigError(f"finetune.freeze / lora_rank / adapters / progressive_freeze are supported with data, "
                          f"tensor, pipeline, context and expert parallel and ZeRO 1-3 (sync = 'allreduce', no "
                          f"embedding_sharding); here sync = {layout.sync!r}, embedding_sharding = "
                          f"{layout.embedding_sharding!r}: change the layout or drop the [finetune] keys")
    if active(cfg) and layout.tp > 1 and not tp_ok:
        raise ConfigError(f"finetune.adapters with parallel.tp = {layout.tp} is not supported (tensor parallel splits "
                          "frozen, LoRA and QLoRA layers, not bottleneck adapters); set parallel.tp=1 or use "
                          "finetune.lora_rank / finetune.freeze")
    if f.progressive_freeze and layout.zero >= 2 and cfg.model.moe_experts:
        raise ConfigError(f"finetune.progressive_freeze with model.moe_experts and parallel.zero = {layout.zero}: a "
                          "frozen MoE block's load-balancing loss still reaches back into it, where FSDP2 has not "
                          "gathered the parameters again; use parallel.zero=0 or a fixed finetune.freeze")


def apply_finetune(model: nn.Module, ft) -> nn.Module:
    """Freeze the configured parameters, then add LoRA or bottleneck adapters (which freeze everything but
    themselves)."""
    if ft.freeze:
        freeze(model, ft.freeze)
    if ft.lora_rank > 0:
        apply_lora(model, ft.lora_rank, ft.lora_alpha, ft.lora_targets, quantize=ft.quantize_base)
    if ft.adapters:
        apply_adapters(model, ft.adapters.get("size", 16), targets_of(model, ft.adapters))
    return model


__all__ = ["AdapterLinear", "LoRALinear", "adapter_layers", "adapters_state_dict", "apply_adapters", "targets_of",
            "ProgressiveFreeze", "active", "adapter_state_dict", "apply_finetune", "apply_lora",
           "check_layout", "freeze", "freeze_steps", "lora_layers", "merge_lora", "trainable_params"]


@contextlib.contextmanager
def base_model(model: nn.Module):
    """The model without its adapters while inside (peft's disable_adapter()): every LoRA and bottleneck adapter is
    left out of its layer's forward, a merged LoRA layer unmerged for the while. Preference tuning's reference model
    is this: the frozen base, no second copy (plait.train.preference)."""
    layers = [m for m in model.modules() if isinstance(m, (LoRALinear, AdapterLinear))]
    merged = [m for m in layers if isinstance(m, LoRALinear) and m.merged]
    for m in merged:
        m.unmerge()
    for m in layers:
        m.off = True
    try:
        yield model
    finally:
        for m in layers:
            m.off = False
        for m in merged:
            m.merge()
