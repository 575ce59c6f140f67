"""Tensor parallel (Megatron-LM) with DTensor: the model declares its plan (`tp_plan`), this applies it.

A transform only: the step stays the single-replica one (dp = 1), DDP's by-hand average (dp > 1)
or FSDP's (zero >= 2); DTensor gradients are aligned with their parameters after backward and
clipped by their full norms (plait.parallel.gradsync).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor.parallel import parallelize_module

from plait.errors import ConfigError
from plait.models import capabilities
from plait.parallel.scheme import Build, Scheme


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool) -> nn.Module:
    """Split the model's matrices over the tp axis; parameter names do not change."""
    if not hasattr(model, "tp_plan"):
        raise ConfigError(f"{type(model).__name__} declares no tensor-parallel plan (tp_plan); set parallel.tp=1")
    model.tp_check(tp_mesh.size())
    tied = getattr(model, "tied_parameters", dict)()
    parallelize_module(model, tp_mesh, model.tp_plan(sequence_parallel))
    # parallelize_module replaces each module's parameters one module at a time: a weight shared by
    # two modules comes out as two DTensors with equal values. Share them again.
    for alias, canonical in tied.items():
        src, dst = _owner(model, canonical), _owner(model, alias)
        if src is not None and dst is not None:  # a pipeline stage may hold only one of the two
            setattr(dst[0], dst[1], getattr(src[0], src[1]))
    return model


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str] | None:
    """(module, attribute) holding parameter `name`, or None when this model (stage) does not have it."""
    path, _, leaf = name.rpartition(".")
    try:
        mod = model.get_submodule(path) if path else model
    except AttributeError:
        return None
    return (mod, leaf) if getattr(mod, leaf, None) is not None else None


def check(cfg) -> None:
    p = cfg.parallel
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel = true needs parallel.tp > 1; set parallel.tp=2 or turn it off")
    if p.tp > 1:
        if "tensor_parallel" not in capabilities(cfg.model):
            what = cfg.model.factory or f"model.name = {cfg.model.name!r}"
            raise ConfigError(
                f"parallel.tp = {p.tp} splits the model's matrices, but {what} declares no tensor-parallel plan "
                "(a `tp_plan(sequence_parallel)` method, see plait.models.gpt); set parallel.tp=1")
        m = cfg.model
        if not m.factory and m.name == "gpt" and m.heads % p.tp:
            raise ConfigError(f"model.heads ({m.heads}) is not divisible by parallel.tp = {p.tp}; "
                              f"set model.heads to a multiple of {p.tp}")


def transform(model: nn.Module, b: Build) -> nn.Module:
    return apply_tp(model, b.rt.mesh["tp"], b.cfg.parallel.sequence_parallel)


SCHEME = Scheme("tensor_parallel", applies=lambda cfg: cfg.parallel.tp > 1, check=check, transform=transform)
