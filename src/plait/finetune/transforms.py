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

from plait.finetune.adapters import AdapterLinear, adapter_layers, adapters_state_dict, apply_adapters, targets_of
from plait.finetune.freezing import freeze, trainable_params
from plait.finetune.keys import active, check_layout  # torch-free: the job check reads them (re-exported)
from plait.finetune.lora import LoRALinear, adapter_state_dict, apply_lora, lora_layers, merge_lora
from plait.finetune.progressive import ProgressiveFreeze, freeze_steps


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
