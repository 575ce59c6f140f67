"""Fine-tuning transforms on the plain model, applied before any parallel scheme wraps it (docs/finetune.md).

    apply_finetune(model, cfg.finetune)   # [finetune] freeze patterns, then LoRA adapters
    check_layout(cfg, layout)             # the layouts freezing, LoRA and progressive freezing are tested with

The names below are imported on first use (PEP 562): plait.finetune.keys, the section's keys, is read by
`plait config show`, which must not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_FROM = {"LoRALinear": "lora", "adapter_state_dict": "lora", "apply_lora": "lora", "lora_layers": "lora",
         "merge_lora": "lora", "usual_targets": "lora", "freeze": "freezing", "trainable_params": "freezing",
         "ProgressiveFreeze": "progressive",
         "freeze_steps": "progressive", "check_progressive": "progressive", "active": "keys",
         "apply_finetune": "transforms", "base_model": "transforms", "check_layout": "keys", "AdapterLinear": "adapters",
         "adapter_layers": "adapters", "adapters_state_dict": "adapters", "apply_adapters": "adapters",
         "targets_of": "adapters"}
__all__ = sorted(_FROM)


def __getattr__(name: str) -> Any:
    if name in _FROM:
        module = importlib.import_module(f"plait.finetune.{_FROM[name]}")
        return getattr(module, "check" if name == "check_progressive" else name)
    raise AttributeError(f"module 'plait.finetune' has no attribute {name!r}")
