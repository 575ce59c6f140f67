"""Tensor parallel (plait.parallel.tp): the plan it asks of the model, and how its matrices divide over tp."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.errors import ConfigError
from plait.models.keys import CAPABILITIES
from plait.parallel.keys import TensorParallelKeys
from plait.parallel.layout import Layout
from plait.parallel.scheme import Scheme
from plait.parallel.schemes.expert import check_experts_tp

if TYPE_CHECKING:
    import torch.nn as nn


def check(layout: Layout, keys: TensorParallelKeys) -> None:
    if keys.sequence_parallel and layout.tp == 1:
        raise ConfigError("parallel.sequence_parallel = true needs parallel.tp > 1; set parallel.tp=2 or turn it off")


def check_model(layout: Layout, keys: TensorParallelKeys, m, model: nn.Module | None) -> None:
    """The model has a tensor-parallel plan whose matrices divide over tp (model None: the registered one m names)."""
    tp_degree = layout.tp
    check_experts_tp(m, layout, keys.sequence_parallel)
    if model is None:
        if "tensor_parallel" not in CAPABILITIES.get(m.name, frozenset()):
            raise _no_plan(tp_degree, f"model.name = {m.name!r}")
        if m.name == "gpt" and m.heads % tp_degree:
            raise ConfigError(f"model.heads ({m.heads}) is not divisible by parallel.tp = {tp_degree}; "
                              f"set model.heads to a multiple of {tp_degree}")
        return
    from plait.models.protocols import check_tensor_parallel, check_tp_plan, tensor_parallel_plan  # only for a model object (torch)

    plan = tensor_parallel_plan(model, keys.sequence_parallel)
    if plan is None:
        raise _no_plan(tp_degree, m.factory or type(model).__name__)
    check_tensor_parallel(model, tp_degree)
    check_tp_plan(model, plan, tp_degree)


def _no_plan(tp_degree: int, what: str) -> ConfigError:
    return ConfigError(
        f"parallel.tp = {tp_degree} splits the model's matrices, but {what} declares no tensor-parallel plan "
        "(a `tp_plan(sequence_parallel)` method; `tp_plan = megatron_plan` for the common patterns, see "
        "docs/models.md; a transformers model: its class's _tp_plan); set parallel.tp=1")


SCHEME = Scheme("tensor_parallel", applies=lambda layout, keys: layout.tp > 1, keys=TensorParallelKeys, check=check,
                check_model=check_model, transform="plait.parallel.tp:transform")
