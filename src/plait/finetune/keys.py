"""The [finetune] section: freezing, LoRA/QLoRA, progressive freezing, and which layouts they compose with.
Torch-free: the job check reads them before anything imports torch.

The keys' own rules need no layout; `check_layout(cfg, layout)` is what each asks of the layout.
"""

from __future__ import annotations

import importlib.util
import math

from plait.config import keys, opt
from plait.errors import ConfigError
from plait.extras import install_command


@keys("finetune")
class FinetuneKeys:
    freeze: list = opt([], "glob patterns over parameter names to freeze (no gradient, optimizer state or traffic), "
                           "e.g. ['tok_emb*', 'blocks.0.*']")
    lora_rank: int = opt(0, "LoRA: rank of the adapters on the target Linear layers (0: off); the base stays frozen")
    lora_alpha: float = opt(16.0, "LoRA: the adapter output is scaled by lora_alpha / lora_rank")
    lora_targets: list = opt([], "LoRA: glob patterns over the names of the Linear layers to adapt; [] takes the "
                                 "model's usual query and value projections, as peft does ('*attn.q', '*attn.v' on "
                                 "plait's gpt, 'q_proj', 'v_proj' on Llama-family models; the run records them)")
    quantize_base: str = opt("none", "QLoRA: store the adapted layers' frozen base weights in 4-bit NormalFloat (nf4, "
                                     "bitsandbytes: plait[qlora]) or not (none)", ("none", "nf4"))

    @property
    def active(self) -> bool:
        return bool(self.freeze) or self.lora_rank > 0

    def check(self, cfg) -> None:
        if not isinstance(self.freeze, list) or not all(isinstance(p, str) and p for p in self.freeze):
            raise ConfigError(f"finetune.freeze = {self.freeze!r} must be a list of glob patterns, e.g. "
                              "['tok_emb*', 'blocks.0.*']")
        if self.lora_rank < 0:
            raise ConfigError(f"finetune.lora_rank = {self.lora_rank} must be >= 0 (0: no LoRA), e.g. 8")
        if not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ConfigError(f"finetune.lora_alpha = {self.lora_alpha} must be > 0, e.g. 16")
        if self.lora_rank and (not isinstance(self.lora_targets, list)
                               or not all(isinstance(p, str) and p for p in self.lora_targets)):
            raise ConfigError(f"finetune.lora_targets = {self.lora_targets!r} must be a list of glob patterns over "
                              "Linear layer names, e.g. ['q_proj', 'v_proj'] ([]: the model's usual ones)")
        if self.quantize_base != "none":
            if not self.lora_rank:
                raise ConfigError(f"finetune.quantize_base = {self.quantize_base!r} quantizes the base under LoRA "
                                  "adapters: set finetune.lora_rank (e.g. 8) or finetune.quantize_base='none'")
            if importlib.util.find_spec("bitsandbytes") is None:
                raise ConfigError(f"finetune.quantize_base = 'nf4' uses bitsandbytes: {install_command('qlora')}, or set "
                                  "finetune.quantize_base='none'")
        if self.lora_rank and cfg.train.compile:
            raise ConfigError("finetune.lora_rank with train.compile = true is not supported yet; set train.compile=false")


@keys("finetune")
class ProgressiveFreezeKeys:
    progressive_freeze: bool = opt(False, "freeze model.blocks front to back during training (FreezeOut): block i of L "
                                          "after floor(t0 + i (T - t0) / L) steps, t0 = progressive_freeze_start * T")
    progressive_freeze_start: float = opt(0.5, "progressive_freeze: the share of train.steps before block 0 freezes")

    def check(self, cfg) -> None:
        if not 0.0 <= self.progressive_freeze_start < 1.0:
            raise ConfigError(f"finetune.progressive_freeze_start = {self.progressive_freeze_start} must be in [0, 1) "
                              "(the share of train.steps before block 0 freezes), e.g. 0.5")
        if self.progressive_freeze and cfg.train.compile:
            raise ConfigError("finetune.progressive_freeze moves a hook between blocks during training, which "
                              "recompiles the model each time; set train.compile=false")


ADAPTER_KEYS = {"size", "variant", "targets"}


@keys("finetune")
class AdapterKeys:
    adapters: dict = opt({}, "bottleneck adapters after each block's output projections, the base frozen: {size = 16, "
                             "variant = 'houlsby'} (after attention and MLP) or 'pfeiffer' (after the MLP), or "
                             "targets = [glob, ...] over Linear layer names; {} off")

    def check(self, cfg) -> None:
        if not self.adapters:
            return
        check_adapters(self.adapters)
        if cfg.finetune.lora_rank > 0:
            raise ConfigError("finetune.adapters with finetune.lora_rank > 0: choose one kind of adapter (set "
                              "finetune.lora_rank=0 or finetune.adapters={})")


def check_adapters(spec: dict, key: str = "finetune.adapters") -> None:
    unknown = sorted(set(spec) - ADAPTER_KEYS)
    if unknown:
        raise ConfigError(f"{key} has unknown keys {unknown}; it takes size, variant and targets, e.g. "
                          "{size = 16, variant = 'houlsby'}")
    size = spec.get("size", 16)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"{key}.size = {size!r} must be an integer >= 1 (the bottleneck width), e.g. 16")
    if spec.get("variant", "houlsby") not in ("houlsby", "pfeiffer"):
        raise ConfigError(f"{key}.variant = {spec['variant']!r}: choose houlsby (after attention and MLP) or pfeiffer "
                          "(after the MLP)")
    targets = spec.get("targets")
    if targets is not None and not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
        raise ConfigError(f"{key}.targets = {targets!r} must be a non-empty list of glob patterns over Linear layer "
                          "names, e.g. ['*mlp.down']")


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
