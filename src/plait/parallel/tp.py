"""Tensor parallel (Megatron-LM) with DTensor: the model declares its plan (`tp_plan`), this applies it.

A transform only: the step stays the single-replica one (dp = 1), DDP's by-hand average (dp > 1)
or FSDP's (zero >= 2); DTensor gradients are aligned with their parameters after backward and
clipped by their full norms (plait.parallel.gradsync).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor.parallel import parallelize_module

from plait.errors import ConfigError
from plait.finetune.lora_tp import tp_styles
from plait.models.protocols import check_tensor_parallel, tensor_parallel_plan, tied_parameters
from plait.parallel.scheme import Build


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool) -> nn.Module:
    """Split the model's matrices over the tp axis; parameter names do not change."""
    plan = tensor_parallel_plan(model, sequence_parallel)
    if plan is None:
        raise ConfigError(f"{type(model).__name__} declares no tensor-parallel plan (tp_plan, docs/models.md); "
                          "set parallel.tp=1")
    check_tensor_parallel(model, tp_mesh.size())
    tied = tied_parameters(model)
    parallelize_module(model, tp_mesh, tp_styles(model, plan, tp_mesh.size()))  # LoRA splits adapters with weights
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


def transform(model: nn.Module, b: Build) -> nn.Module:
    model = apply_tp(model, b.rt.mesh["tp"], b.layout.sequence_parallel)
    if not b.layout.shards_gradients:  # shard-only initialisation: this rank's pieces now (with FSDP: once it has sharded)
        b.materialize(model)
    return model
