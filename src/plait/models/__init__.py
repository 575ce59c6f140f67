"""Reference models and the registry: `build_model(cfg.model, spec)` returns a plain nn.Module.

Every model maps the data's inputs to logits; the loss comes from the data's task
(see plait.train.loss). Models that have repeated blocks expose them as
`model.blocks` (an nn.ModuleList or nn.ModuleDict) so that activation checkpointing, compile and
later sharding can work per block without knowing the model.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch.nn as nn

from plait.data.spec import DataSpec
from plait.errors import ConfigError
from plait.models.cnn import build_cnn
from plait.models.deepfm import build_deepfm
from plait.models.gpt import build_gpt
from plait.models.mlp import build_mlp

MODELS: dict[str, Callable] = {"gpt": build_gpt, "mlp": build_mlp, "cnn": build_cnn, "deepfm": build_deepfm}


def load_factory(path: str) -> Callable:
    """Import 'package.module:function'."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"model.factory = {path!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"model.factory = {path!r}: {module_name} has no callable {attr!r}")
    return fn


def build_model(model_cfg, spec: DataSpec) -> nn.Module:
    """Build the configured model on the current default device, parameters initialised from torch's RNG."""
    if model_cfg.factory:
        model = load_factory(model_cfg.factory)(**model_cfg.options)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model.factory = {model_cfg.factory!r} returned {type(model).__name__}, not an nn.Module")
        return model
    if model_cfg.name not in MODELS:
        raise ConfigError(f"model.name = {model_cfg.name!r} is not one of: {', '.join(sorted(MODELS))}")
    return MODELS[model_cfg.name](model_cfg, spec)


def model_metadata(model_cfg, spec: DataSpec) -> dict:
    """What it takes to rebuild the model: stored in exports and used by serving."""
    import dataclasses

    return {"model": dataclasses.asdict(model_cfg), "spec": dataclasses.asdict(spec)}
