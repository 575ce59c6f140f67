"""Fine-tuning transforms on the plain model, applied before any parallel scheme wraps it (docs/finetune.md).

    apply_finetune(model, cfg.finetune)   # [finetune] freeze patterns, then LoRA adapters
    check(cfg)                            # the section's rules and the layouts it is tested with

Both act on the plain model's names and on `requires_grad`, so every scheme that builds its gradient
synchronisation and optimizer from the parameters that require a gradient (DDP, ZeRO-1, FSDP2 for
ZeRO-2/3) sends, stores and updates only what trains.
"""

from __future__ import annotations

import math

import torch.nn as nn

from plait.errors import ConfigError
from plait.finetune.freeze import freeze, trainable_params
from plait.finetune.lora import LoRALinear, adapter_state_dict, apply_lora, lora_layers, merge_lora
from plait.finetune.progressive import ProgressiveFreeze, freeze_steps
from plait.finetune.progressive import check as check_progressive


def active(cfg) -> bool:
    return bool(cfg.finetune.freeze) or cfg.finetune.lora_rank > 0 or cfg.finetune.progressive_freeze


def check(cfg) -> None:
    """The [finetune] section's values, and the layouts freezing and LoRA are tested with (dp, ZeRO 1-3)."""
    f = cfg.finetune
    if not isinstance(f.freeze, list) or not all(isinstance(p, str) and p for p in f.freeze):
        raise ConfigError(f"finetune.freeze = {f.freeze!r} must be a list of glob patterns, e.g. ['tok_emb*', 'blocks.0.*']")
    if f.lora_rank < 0:
        raise ConfigError(f"finetune.lora_rank = {f.lora_rank} must be >= 0 (0: no LoRA), e.g. 8")
    if not (math.isfinite(f.lora_alpha) and f.lora_alpha > 0):
        raise ConfigError(f"finetune.lora_alpha = {f.lora_alpha} must be > 0, e.g. 16")
    if f.lora_rank and (not isinstance(f.lora_targets, list) or not f.lora_targets
                        or not all(isinstance(p, str) and p for p in f.lora_targets)):
        raise ConfigError(f"finetune.lora_targets = {f.lora_targets!r} must be a non-empty list of glob patterns over "
                          "Linear layer names, e.g. ['*attn.q', '*attn.v']")
    if f.quantize_base != "none":
        if not f.lora_rank:
            raise ConfigError(f"finetune.quantize_base = {f.quantize_base!r} quantizes the base under LoRA adapters: "
                              "set finetune.lora_rank (e.g. 8) or finetune.quantize_base='none'")
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise ConfigError("finetune.quantize_base = 'nf4' uses bitsandbytes: pip install 'plait[qlora]', or set "
                              "finetune.quantize_base='none'") from None
        if cfg.parallel.zero:
            raise ConfigError("finetune.quantize_base = 'nf4' is supported with data parallel (parallel.zero = 0): ZeRO "
                              "would not shard its 4-bit buffers; set parallel.zero=0")
    check_progressive(cfg)
    if not active(cfg):
        return
    p = cfg.parallel
    if p.tp > 1 or p.pp > 1 or p.sync != "allreduce" or p.ep > 1 or p.embedding_sharding != "none":
        raise ConfigError(f"finetune.freeze / lora_rank / progressive_freeze are supported with data parallel and ZeRO "
                          f"1-3 (tp = pp = ep = 1, sync = 'allreduce', no embedding_sharding); here tp = {p.tp}, pp = {p.pp}, "
                          f"ep = {p.ep}, sync = {p.sync!r}: change the layout or drop the [finetune] keys")
    if f.lora_rank and cfg.train.compile:
        raise ConfigError("finetune.lora_rank with train.compile = true is not supported yet; set train.compile=false")


def apply_finetune(model: nn.Module, ft) -> nn.Module:
    """Freeze the configured parameters, then add LoRA adapters (which freeze everything but themselves)."""
    if ft.freeze:
        freeze(model, ft.freeze)
    if ft.lora_rank > 0:
        apply_lora(model, ft.lora_rank, ft.lora_alpha, ft.lora_targets, quantize=ft.quantize_base)
    return model


__all__ = ["LoRALinear", "ProgressiveFreeze", "active", "adapter_state_dict", "apply_finetune", "apply_lora", "check",
           "check_progressive", "freeze", "freeze_steps", "lora_layers", "merge_lora", "trainable_params"]
