"""LoRA under tensor parallel: each adapter split as its layer's weight is split (plait.parallel.tp applies the plan).

Kept apart from plait.finetune.lora so that loading or merging adapters (serving, export) does not import DTensor.
"""

from __future__ import annotations

import copy
from functools import partial

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from plait.errors import ConfigError
from plait.finetune.lora import NF4_BLOCK, LoRALinear


def _check_nf4_split(name: str, mod: LoRALinear, by_columns: bool, tp: int) -> None:
    """An nf4 base splits over tp only along its 64-value blocks: whole blocks in every row, and by columns (row-wise
    parallel) whole blocks in each rank's share of a row."""
    cols = mod.in_features // tp if by_columns else mod.in_features
    if mod.in_features % NF4_BLOCK or cols % NF4_BLOCK or (by_columns and mod.in_features % tp):
        raise ConfigError(
            f"finetune.quantize_base = 'nf4' with parallel.tp = {tp}: {name} ({mod.out_features} x {mod.in_features}) "
            f"would split its nf4 blocks of {NF4_BLOCK} values ({cols} columns of each row on a rank); tensor "
            f"parallel needs whole blocks on every rank: widen the layer to a multiple of {NF4_BLOCK * tp} inputs, "
            "leave it out of finetune.lora_targets, or set parallel.tp=1")


def tp_styles(model: nn.Module, plan: dict, tp: int = 1) -> dict:
    """The plan with each style that targets a LoRA layer made to split its adapter as it splits the weight.

    Column-parallel (the weight split by output rows): B is split the same way and A, shared by every output, is
    whole on each rank, so each rank computes its own output columns, B_r (A x). Row-parallel (the weight split by
    input columns): A is split the same way and B is whole, so each rank's x_r A_r^T B^T is a partial sum that the
    layer's all-reduce adds up with the base's. Frozen weights stay frozen (requires_grad kept). An nf4 base (QLoRA)
    splits as its weight would, its codes and scales kept by row (plait.finetune.lora.LoRALinear): a rank's rows or
    columns are whole blocks of 64 (tp: the degree, to check that), and each rank dequantizes its own part."""
    out = dict(plan)
    for name, style in plan.items():
        try:
            mod = model.get_submodule(name)
        except AttributeError:
            continue
        if isinstance(mod, LoRALinear) and type(style) in (ColwiseParallel, RowwiseParallel):
            if mod.quantize == "nf4":
                _check_nf4_split(name, mod, isinstance(style, RowwiseParallel), tp)
            lora = copy.copy(style)  # the same layouts, applied to a LoRA layer's four tensors
            lora.__class__ = _LoRAColwise if isinstance(style, ColwiseParallel) else _LoRARowwise
            out[name] = lora
    return out


def _distribute(module: nn.Module, mesh, placements: dict, src_data_rank) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))
    for name in ("weight_nf4", "weight_absmax"):  # QLoRA: codes and scales by row, split as the weight is
        if name in module._buffers:
            module._buffers[name] = distribute_tensor(module._buffers[name], mesh, [placements["weight"]],
                                                      src_data_rank=src_data_rank)


class _LoRAColwise(ColwiseParallel):
    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        places = {"weight": Shard(0), "bias": Shard(0), "lora_A": Replicate(), "lora_B": Shard(0)}
        return distribute_module(
            module, device_mesh, lambda _n, m, mesh: _distribute(m, mesh, places, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class _LoRARowwise(RowwiseParallel):
    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        places = {"weight": Shard(1), "bias": Replicate(), "lora_A": Shard(1), "lora_B": Replicate()}
        self.desired_input_layouts = (Shard(-1),)  # as RowwiseParallel sets for a Linear
        return distribute_module(
            module, device_mesh, lambda _n, m, mesh: _distribute(m, mesh, places, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))
