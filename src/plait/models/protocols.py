"""What a model offers the layouts beyond data parallel: pipeline cut points and a tensor-parallel plan.

    pipeline_parts(model)        # how to cut it: the model's own pipeline_parts(), or an nn.Sequential's children
    pipeline_blocks(model)       # its blocks in order, {name: module}, or None when it cannot be cut
    megatron_plan(model)         # a Megatron-style TP plan for the common patterns (one line in a user's model)
    check_tp_plan(model, plan, tp)   # ConfigError when a split matrix does not divide over tp ranks
    tensor_parallel_plan(model, sp)  # the model's tp_plan, a transformers model's declared one, or None

A model's `pipeline_parts()` returns {"blocks": attribute of an nn.ModuleDict of blocks (or "" for the model
itself, an nn.Sequential), "first": [modules only the first stage keeps], "last": [modules only the last stage
keeps]}. A model's `tp_plan(sequence_parallel)` returns {module name: ParallelStyle} for
torch.distributed.tensor.parallel.parallelize_module. docs/models.md shows both on a user's model.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn

from plait.errors import ConfigError
from plait.models.hf_plans import hf_pipeline_parts, hf_tp_check, hf_tp_plan, shared_parameters

# Modules that act on each feature alone: a Linear pair may have them between its two matrices.
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Softplus,
               nn.Hardswish, nn.Dropout, nn.Identity)
# Attention projections by the names common models give them: (q, k, v) and the output.
QKV_NAMES = (("q", "k", "v"), ("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("wq", "wk", "wv"))
OUT_NAMES = ("proj", "out_proj", "o_proj", "out", "o", "wo", "c_proj")
# Two-matrix feed-forward modules by name: (up, down).
MLP_NAMES = (("up", "down"), ("fc1", "fc2"), ("w1", "w2"), ("c_fc", "c_proj"), ("up_proj", "down_proj"))


# ---- the hooks a model may have (each optional; the layouts ask with isinstance, never by probing names)


@runtime_checkable
class PipelineModel(Protocol):
    def pipeline_parts(self) -> dict: ...  # {"blocks": attr, "first": [...], "last": [...]}


@runtime_checkable
class TensorParallelModel(Protocol):
    def tp_plan(self, sequence_parallel: bool) -> dict: ...  # {module name: ParallelStyle}


@runtime_checkable
class ChecksTensorParallel(Protocol):
    def tp_check(self, tp: int) -> None: ...  # ConfigError when the model cannot split over tp ranks


@runtime_checkable
class TiedModel(Protocol):
    def tied_parameters(self) -> dict[str, str]: ...  # {alias name: canonical name} of weights shared by modules


@runtime_checkable
class ExtraLossModel(Protocol):
    def extra_loss(self) -> torch.Tensor | None: ...  # a term added to each training micro-batch's loss (MoE balance)


@runtime_checkable
class WindowMetricsModel(Protocol):
    # figures for metrics.jsonl on logging steps, summed over the dp ranks by `reduce` (MoE: tokens per expert)
    def window_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor], ranks: int, steps: int) -> dict: ...


@runtime_checkable
class GeneratingModel(Protocol):
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *args: Any, **kwargs: Any) -> torch.Tensor: ...


def is_transformers_model(model: nn.Module) -> bool:
    """A transformers PreTrainedModel. Nothing is imported to ask: such a model's class comes from an imported
    transformers.modeling_utils, and `transformers.PreTrainedModel` on the lazy package would import that module
    (1.5-2 s of CPU; it was 40 % of a tensor-parallel test rank's time)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


def tensor_parallel_plan(model: nn.Module, sequence_parallel: bool = False) -> dict | None:
    """{module name: ParallelStyle}: the model's `tp_plan(sequence_parallel)`, a transformers model's declared plan
    (plait.models.hf_plans), or None when it has none."""
    own = getattr(type(model), "tp_plan", None)
    if is_transformers_model(model) and not callable(own):  # PreTrainedModel.tp_plan is a property, not the hook
        plan = hf_tp_plan(model)
        if plan is not None and sequence_parallel:
            raise ConfigError(f"{type(model).__name__}'s tensor-parallel plan does not shard activations along the "
                              "sequence; set parallel.sequence_parallel=false")
        return plan
    return model.tp_plan(sequence_parallel) if isinstance(model, TensorParallelModel) else None


def check_tensor_parallel(model: nn.Module, tp: int) -> None:
    """The model's own check (`tp_check`), or a transformers model's head counts and vocabulary."""
    if is_transformers_model(model) and not callable(getattr(type(model), "tp_check", None)):
        hf_tp_check(model, tp)
    elif isinstance(model, ChecksTensorParallel):
        model.tp_check(tp)


def tied_parameters(model: nn.Module) -> dict[str, str]:
    """The model's tied weights {alias: canonical}, or none (a transformers model: the parameters it shares)."""
    if isinstance(model, TiedModel):
        return model.tied_parameters()
    if is_transformers_model(model):
        return shared_parameters(model)
    return {}


def pipeline_parts(model: nn.Module) -> dict | None:
    """The model's cut points: its own `pipeline_parts()`, a transformers model's declared `_pp_plan`
    (plait.models.hf_plans), an nn.Sequential's children in order, else None."""
    if isinstance(model, PipelineModel):
        return model.pipeline_parts()
    if is_transformers_model(model):
        return hf_pipeline_parts(model)
    if isinstance(model, nn.Sequential):
        return {"blocks": "", "first": [], "last": []}
    return None


def blocks_module(model: nn.Module, parts: dict) -> nn.Module:
    """The container of the blocks ("" : the model itself)."""
    return model if parts["blocks"] == "" else model.get_submodule(parts["blocks"])


def pipeline_blocks(model: nn.Module) -> dict[str, nn.Module] | None:
    """The blocks a pipeline cuts between, in order ({name: module}), or None when the model cannot be cut."""
    parts = pipeline_parts(model)
    if parts is None:
        return None
    return dict(blocks_module(model, parts).named_children())


def _linear(mod: nn.Module | None) -> bool:
    return isinstance(mod, nn.Linear)


def megatron_plan(model: nn.Module, sequence_parallel: bool = False) -> dict:
    """Megatron-LM's split for the patterns most models use, as a plan for parallelize_module.

    Attention: q, k, v column-parallel and the output row-parallel (each rank keeps whole heads, so the
    model must reshape with -1 heads: `q.view(b, t, -1, head_dim)`). Feed-forward: two Linears in a row
    (in an nn.Sequential, with only activations or dropout between them, or a module's up/down, fc1/fc2
    pair) column- then row-parallel. One all-reduce per pair; everything else is replicated.
    Use it as a method of your model: `tp_plan = plait.models.protocols.megatron_plan`.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if sequence_parallel:
        raise ConfigError("megatron_plan does not shard activations along the sequence; set "
                          "parallel.sequence_parallel=false (or write the plan yourself, see docs/models.md)")
    plan: dict = {}

    def pair(a: str, b: str) -> None:
        if a not in plan and b not in plan:
            plan[a], plan[b] = ColwiseParallel(), RowwiseParallel()

    for prefix, mod in model.named_modules():
        at = f"{prefix}." if prefix else ""
        children = dict(mod.named_children())
        for qkv in QKV_NAMES:
            out = next((o for o in OUT_NAMES if _linear(children.get(o))), None)
            if out and all(_linear(children.get(n)) for n in qkv):
                for n in qkv:
                    plan[at + n] = ColwiseParallel()
                plan[at + out] = RowwiseParallel()
        for up, down in MLP_NAMES:
            if _linear(children.get(up)) and _linear(children.get(down)):
                pair(at + up, at + down)
                if up == "up_proj" and _linear(children.get("gate_proj")):  # SwiGLU: the gate splits as up does
                    plan[at + "gate_proj"] = ColwiseParallel()
        if isinstance(mod, nn.Sequential):
            pending = None
            for name, child in children.items():
                if _linear(child):
                    if pending is not None and children[pending].out_features == child.in_features:
                        pair(at + pending, at + name)
                        pending = None
                    else:
                        pending = name
                elif not isinstance(child, ELEMENTWISE):
                    pending = None
    return plan


def check_tp_plan(model: nn.Module, plan: dict, tp: int) -> None:
    """Every column-parallel Linear's outputs and row-parallel Linear's inputs must divide over tp ranks."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not plan:
        raise ConfigError(f"parallel.tp = {tp}: the model's tensor-parallel plan splits nothing (no attention "
                          "q/k/v/out or Linear pairs found); give it a tp_plan (docs/models.md) or set parallel.tp=1")
    for name, style in plan.items():
        try:
            mod = model.get_submodule(name)
        except AttributeError:
            raise ConfigError(f"parallel.tp = {tp}: the tensor-parallel plan names {name!r}, which the model does not "
                              "have; fix its tp_plan") from None
        if not _linear(mod):
            continue
        dim, size = (("out_features", mod.out_features) if isinstance(style, ColwiseParallel)
                     else ("in_features", mod.in_features) if isinstance(style, RowwiseParallel) else (None, 0))
        if dim and size % tp:
            raise ConfigError(f"parallel.tp = {tp} splits {name} ({dim} = {size}), which is not divisible by {tp}; "
                              f"make it a multiple of {tp} or set parallel.tp=1")
