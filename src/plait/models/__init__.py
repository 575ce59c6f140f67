"""plait's models and the model registry (plait.models.registry): build_model, capabilities, the model hooks.

    model = build_model(cfg.model, spec)     # a registered model (MODELS, plait.models.keys) or model.factory's

The names below are imported on first use (PEP 562): plait.models.keys, the [model] section's keys, is read
by `plait config show`, which must not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["CAPABILITIES", "DATA_FOR", "MODELS", "build_model", "capabilities", "check_config", "check_moe",
           "expert_counts", "load_factory", "megatron_plan", "model_metadata", "pipeline_parts"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("plait.models.registry"), name)
    raise AttributeError(f"module 'plait.models' has no attribute {name!r}")
