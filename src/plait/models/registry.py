"""Reference models and the registry: `build_model(cfg.model, spec)` returns a plain nn.Module.

Every model maps the data's inputs to logits; the loss comes from the data's task
(see plait.train.loss). Models that have repeated blocks expose them as
`model.blocks` (an nn.ModuleList or nn.ModuleDict) so that activation checkpointing, compile and
later sharding can work per block without knowing the model.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

import torch
import torch.nn as nn

from plait.data.spec import DataSpec
from plait.errors import ConfigError
from plait.models.contrastive import Contrastive
from plait.models.ensemble import build_ensemble
from plait.models.fewshot import MetaLearner
from plait.models.keys import CAPABILITIES
from plait.models.keys import DATA_FOR as DATA_FOR  # re-exported, as the two below: `from plait.models import DATA_FOR`
from plait.models.keys import MODELS as BUILDERS
from plait.models.keys import check_config as check_config  # the registry's declarations, torch-free in models.keys
from plait.models.keys import check_moe as check_moe
from plait.models.moe import moe_layers
from plait.models.protocols import is_transformers_model, pipeline_parts, tensor_parallel_plan
from plait.models.protocols import megatron_plan as megatron_plan  # re-exported: `from plait.models import megatron_plan`


def _builder(ref: str) -> Callable:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


# model.name -> its builder, for every name plait.models.keys publishes
MODELS: dict[str, Callable] = {name: _builder(ref) for name, ref in BUILDERS.items()}


def load_factory(path: str) -> Callable:
    """Import 'package.module:function'."""
    module_name, _, attr = path.partition(":")
    try:
        module = _import_here(module_name)
    except ImportError as e:
        raise ConfigError(f"model.factory = {path!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"model.factory = {path!r}: {module_name} has no callable {attr!r}")
    return fn


def _import_here(module_name: str):
    """Import a module, also from the working directory (as `python -m` would; the `plait` script's path lacks it)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        here = os.getcwd()
        if e.name != module_name.partition(".")[0] or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)  # after everything installed: a local file never shadows a package
        return importlib.import_module(module_name)


def build_model(model_cfg, spec: DataSpec) -> nn.Module:
    """Build the configured model on the current default device, parameters initialised from torch's RNG.

    For a contrastive task (spec.task == "contrastive") the configured model is the encoder (registered
    models output model.width features instead of classes) under a projection head (models.contrastive).
    """
    if spec.task == "contrastive":
        return _contrastive(model_cfg, spec)
    if spec.task == "fewshot":
        return _fewshot(model_cfg, spec)
    if model_cfg.ensemble > 1:
        return _ensemble(model_cfg, spec)
    if model_cfg.factory:
        model = load_factory(model_cfg.factory)(**model_cfg.options)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model.factory = {model_cfg.factory!r} returned {type(model).__name__}, not an nn.Module")
        return unwrap_outputs(model)
    if model_cfg.name not in MODELS:
        raise ConfigError(f"model.name = {model_cfg.name!r} is not one of: {', '.join(sorted(MODELS))}")
    return MODELS[model_cfg.name](model_cfg, spec)


def _ensemble(model_cfg, spec: DataSpec) -> nn.Module:
    """model.ensemble = K: K members of the model, member k from the seed set last + k (plait.models.ensemble)."""
    import dataclasses


    if spec.task not in ("classification", "lm"):
        raise ConfigError(f"model.ensemble = {model_cfg.ensemble} averages the members' class probabilities; this "
                          f"data's task is {spec.task!r}: set model.ensemble=1")
    one = dataclasses.replace(model_cfg, ensemble=1)
    return build_ensemble(model_cfg.ensemble, lambda: build_model(one, spec))


def _fewshot(model_cfg, spec: DataSpec) -> nn.Module:
    """train.objective = 'meta': the configured model classifies one episode's `ways` classes; a MetaLearner adapts it
    to each episode (plait.models.fewshot)."""
    import dataclasses


    e = spec.episode
    one = dataclasses.replace(spec, task="classification", num_classes=e["ways"], input_shape=e["input_shape"],
                              episode={})
    return MetaLearner(build_model(model_cfg, one), e["ways"], e["shots"], e["queries"], e["algorithm"],
                       e["inner_steps"], e["inner_lr"])


def _logits(module: nn.Module, args, output):
    return output.logits


def _ids_and_mask(module: nn.Module, args: tuple, kwargs: dict):
    """Inputs (batch, 2, time) are token ids, then their attention mask (data.text_column)."""
    if args and args[0].dim() == 3 and args[0].shape[1] == 2 and not args[0].is_floating_point():
        return (), {**kwargs, "input_ids": args[0][:, 0], "attention_mask": args[0][:, 1]}
    return None


def unwrap_outputs(model: nn.Module) -> nn.Module:
    """A transformers model (a PreTrainedModel: its forward returns a ModelOutput) returns its `.logits` instead,
    and takes inputs of ids and an attention mask stacked (batch, 2, time) as its input_ids and attention_mask.

    Hooks, so the parameter names stay the model's own (a checkpoint of it is its state dict).
    """
    if is_transformers_model(model):
        model.register_forward_pre_hook(_ids_and_mask, with_kwargs=True)
        model.register_forward_hook(_logits)
    return model


def _contrastive(model_cfg, spec: DataSpec) -> nn.Module:
    import dataclasses

    import torch

    inner = dataclasses.replace(spec, task="classification", num_classes=model_cfg.width)
    encoder = build_model(model_cfg, inner)
    with torch.no_grad():  # the encoder's output width, from one sample
        out = encoder(torch.zeros(1, *spec.input_shape))
    if out.dim() != 2:
        what = model_cfg.factory or f"model.name = {model_cfg.name!r}"
        raise ConfigError(f"train.objective = 'contrastive' needs a model that outputs one embedding per sample "
                          f"(batch, features), but {what} outputs shape {tuple(out.shape)}; use an encoder model or "
                          "set train.objective='supervised'")
    return Contrastive(encoder, out.shape[1], model_cfg.projection_dim)


def capabilities(model_cfg) -> frozenset[str]:
    """"pipeline" (it has pipeline cut points) and "tensor_parallel" (a TP plan), where the model has them.

    A user's factory is called on the meta device (no memory, no initialisation cost) and its
    model asked for `pipeline_parts` (an nn.Sequential has them) and `tp_plan`.
    """
    if not model_cfg.factory:
        return CAPABILITIES.get(model_cfg.name, frozenset())
    import torch

    with torch.device("meta"):
        model = load_factory(model_cfg.factory)(**model_cfg.options)
    found = {"pipeline"} if pipeline_parts(model) is not None else set()
    if tensor_parallel_plan(model) is not None:
        found.add("tensor_parallel")
    return frozenset(found)


def expert_counts(model_cfg) -> list[int]:
    """Experts of each mixture-of-experts layer the configured model has (empty: none).

    A user's factory is called on the meta device and its plait.models.moe.MoE layers counted.
    """
    if model_cfg.factory:
        with torch.device("meta"):
            model = load_factory(model_cfg.factory)(**model_cfg.options)
        return [m.experts for m in moe_layers(model)]
    if model_cfg.name not in ("gpt", "llama") or model_cfg.moe_experts <= 0 or model_cfg.moe_every < 1:
        return []
    return [model_cfg.moe_experts] * (model_cfg.layers // model_cfg.moe_every)


def model_metadata(model_cfg, spec: DataSpec) -> dict:
    """What it takes to rebuild the model: stored in exports and used by serving."""
    import dataclasses

    return {"model": dataclasses.asdict(model_cfg), "spec": dataclasses.asdict(spec)}
