"""Weights from elsewhere: a run's trained model (LoRA adapters merged) and `train.init_from`.

    cfg, spec, model = load_run_model("runs/x")       # the run's latest checkpoint in a plain model
    init_from(model, "runs/x" | "model.safetensors")  # names and shapes checked, then copied in
    parts = checkpoint_parts(source, meta_model)       # {name: Lazy}: what each rank reads its shards from

`init_from` runs on the plain model before any scheme wraps it, so it works at every layout; the step,
the optimizer and the schedule start fresh (a resumed run loads its own checkpoint over it). Where the
layout shards the model and parallel.shard_init is on, a Hugging Face directory or a safetensors file is
not read here: the model is built on the meta device and each rank reads only its own slices once the
scheme has cut it (`checkpoint_parts`, plait.models.meta.materialize).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from plait.config import load_config
from plait.data.spec import DataSpec
from plait.errors import CheckpointError, ConfigError
from plait.finetune import apply_adapters, apply_lora, merge_lora, targets_of
from plait.models import build_model
from plait.models.hf import hf_lazy_state_dict, hf_native_parts, is_hf_dir
from plait.models.lazy import safetensors_file
from plait.models.protocols import is_transformers_model
from plait.train.checkpoint import latest_checkpoint, load_model_weights


def build_run_model(run_dir: Path, adapters: bool = True):
    """The run's config, data spec and a freshly built model (with the run's LoRA adapters if it had any)."""
    if not (run_dir / "config.toml").is_file():
        raise CheckpointError(f"{run_dir} is not a plait run directory (no config.toml); pass the --out of a run")
    cfg = load_config(run_dir / "config.toml", validate=False)
    spec_file = run_dir / "spec.json"
    if not spec_file.is_file():
        raise CheckpointError(f"{spec_file} is missing; is {run_dir} a plait run directory?")
    spec = DataSpec(**json.loads(spec_file.read_text()))
    return cfg, spec, trained_layers(build_model(cfg.model, spec), cfg.finetune, lora=adapters)


def trained_layers(model: nn.Module, ft, lora: bool = True) -> nn.Module:
    """A freshly built model given the layers [finetune] added to the run's (LoRA unless lora=False, bottleneck
    adapters), so that the run's state dict loads into it; `merge_lora` then gives the plain model back."""
    if lora and ft.lora_rank > 0:
        apply_lora(model, ft.lora_rank, ft.lora_alpha, ft.lora_targets, quantize=ft.quantize_base)
    if ft.adapters:  # not merged away: always part of the model
        apply_adapters(model, ft.adapters.get("size", 16), targets_of(model, ft.adapters))
    return model


def load_run_model(run_dir: str | Path, checkpoint: str | Path | None = None, merge: bool = True):
    """(cfg, spec, model): the run's latest (or given) checkpoint in its plain model; LoRA adapters merged unless merge=False."""
    run_dir = Path(run_dir)
    cfg, spec, model = build_run_model(run_dir)
    ckpt = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir)
    if ckpt is None:
        raise CheckpointError(f"{run_dir} has no checkpoint yet; train it first (checkpoints/latest is missing)")
    load_model_weights(model, ckpt)
    if merge:
        merge_lora(model)
    return cfg, spec, model


def check_fit(source: str, have: dict[str, tuple], want: dict[str, tuple], key: str = "train.init_from") -> None:
    """Names and shapes of `have` (the source) against `want` (the model), in the model's order; the first difference raises."""
    for name, shape in want.items():
        if name not in have:
            raise ConfigError(f"{key} = {source!r} does not fit the model: tensor {name} (shape {list(shape)}) is missing "
                              f"from it (it has {len(have)} tensors, e.g. {list(have)[:3]}); build the same model or "
                              "change train.init_from")
        if tuple(have[name]) != tuple(shape):
            raise ConfigError(f"{key} = {source!r} does not fit the model: tensor {name} has shape {list(have[name])} "
                              f"there and {list(shape)} in the model; set the [model] keys the weights were trained with")
    extra = [n for n in have if n not in want]
    if extra:
        raise ConfigError(f"{key} = {source!r} does not fit the model: it has tensors the model does not, first {extra[0]} "
                          f"(shape {list(have[extra[0]])}); build the same model or change train.init_from")


def checkpoint_parts(source: str | Path, model: nn.Module) -> dict | None:
    """{plait name: Lazy} of `train.init_from` when it can be read in parts (a Hugging Face directory or a
    safetensors file), names and shapes checked against `model` (which may be on the meta device); None for a run
    directory, whose weights come from building the run's own model."""
    path = Path(source)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if is_hf_dir(path) and is_transformers_model(model):  # model.hf_class: the checkpoint's own names
        parts, fresh = hf_native_parts(path, model)
        if fresh:
            print(f"note: train.init_from = {str(source)!r} has no {', '.join(fresh[:4])}"
                  f"{f' (and {len(fresh) - 4} more)' if len(fresh) > 4 else ''}: kept at their fresh initialisation")
        return parts
    if is_hf_dir(path):  # a Hugging Face directory: renamed and reshaped to plait's model (plait.models.hf)
        emb = getattr(model, "tok_emb", None)
        parts = hf_lazy_state_dict(path, getattr(model, "context", None),
                                   rows=emb.weight.shape[0] if emb is not None else None)
    elif path.is_dir():
        return None
    elif path.is_file():
        parts = safetensors_file(path, f"train.init_from = {str(source)!r}")
    else:
        raise ConfigError(f"train.init_from = {str(source)!r} does not exist; give a run directory or a .safetensors file")
    check_fit(str(source), {k: v.shape for k, v in parts.items()}, want)
    return parts


def init_from(model: nn.Module, source: str | Path) -> None:
    """Copy the weights of a run directory (latest checkpoint, adapters merged), a safetensors file or a Hugging Face
    directory into `model`."""
    parts = checkpoint_parts(source, model)
    if parts is None:
        _, _, src = load_run_model(Path(source))
        tensors = src.state_dict()
        check_fit(str(source), {k: tuple(v.shape) for k, v in tensors.items()},
                  {k: tuple(v.shape) for k, v in model.state_dict().items()})
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if parts is None or name in parts:  # a transformers model's new head keeps its fresh weights
                t.copy_(parts[name].full() if parts is not None else tensors[name])
