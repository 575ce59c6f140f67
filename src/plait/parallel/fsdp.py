"""ZeRO stages 2 and 3 with FSDP2 (`fully_shard`): each block, then the root, sharded over the dp axis.

Stage 3 reshards parameters after forward (all-gathered again for backward: 3 Psi per step);
stage 2 keeps them unsharded from forward through backward (2 Psi per step). Gradients are
reduce-scattered and optimizer states sharded in both. Parameters are sharded at rest in
both as well, which FSDP2 does not let us avoid; it only lowers stage 2's memory.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from plait.errors import ConfigError
from plait.parallel.base import DTYPES, Precision, Strategy, model_blocks
from plait.parallel.scheme import Build, Scheme

# Optimizers whose update is elementwise, so that a step on a shard equals that shard of the full step.
SHARDABLE_OPTIMIZERS = ("adamw", "sgd")


def apply_fsdp(model: nn.Module, dp_mesh, stage: int, param_dtype: str = "fp32", offload: bool = False,
               ignored_params: set | None = None) -> nn.Module:
    """Shard each of model.blocks, then the root; stage 3 reshards after forward, stage 2 does not.

    ignored_params stay as they are (expert parallel keeps its experts out and synchronises them itself)."""
    mp = None
    if param_dtype != "fp32":
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)
    kwargs = {"mesh": dp_mesh, "reshard_after_forward": stage == 3, "ignored_params": ignored_params}
    if mp is not None:
        kwargs["mp_policy"] = mp
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in model_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


class FSDPStrategy(Strategy):
    name = "fsdp"
    sharded = True

    def __init__(self, *args, stage: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.name = f"zero{stage}"

    @contextlib.contextmanager
    def no_sync(self):
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)


def shard_init(cfg) -> bool:
    """Whether the model is built on the meta device and each rank materialises only its own shards.

    ZeRO-2/3 (FSDP shards parameters at rest in both; after sharding), tensor parallelism (after its split;
    the shards of a 2-D (dp, tp) DTensor are cut the same way), pipeline stages (each stage its own).
    Expert/embedding layouts, init_from, LoRA and distillation change or read the plain model before it
    is cut, so they keep the whole-model build.
    """
    p, ft = cfg.parallel, cfg.finetune
    return (p.shard_init and ((p.zero >= 2 and p.dp > 1) or p.tp > 1 or p.pp > 1) and p.ep == 1
            and p.embedding_sharding == "none" and p.sync == "allreduce" and not cfg.train.init_from
            and not cfg.distill.teacher and cfg.train.objective != "contrastive" and ft.lora_rank == 0)


def check_zero(cfg, stages: tuple[int, ...]) -> None:
    """What every ZeRO stage needs: data-parallel ranks to shard over and an elementwise optimizer."""
    p = cfg.parallel
    if p.zero not in stages:
        return
    if p.dp == 1:
        raise ConfigError(f"parallel.zero = {p.zero} shards over the data-parallel axis, but parallel.dp = 1; "
                          "set parallel.dp >= 2 or parallel.zero=0")
    if cfg.optim.name not in SHARDABLE_OPTIMIZERS:
        raise ConfigError(f"optim.name = {cfg.optim.name!r} cannot be sharded by ZeRO (its update is not elementwise); "
                          f"use one of {', '.join(SHARDABLE_OPTIMIZERS)} or set parallel.zero=0")


def check(cfg) -> None:
    from plait.parallel import offload

    p = cfg.parallel
    if p.offload == "params" and p.zero < 2:
        raise ConfigError(
            f"parallel.offload = 'params' moves FSDP's parameter, gradient and optimizer shards to CPU memory and needs "
            f"parallel.zero = 2 or 3 (it is {p.zero}); set parallel.zero=3, or parallel.offload='optimizer' (optimizer "
            "state only) or 'disk'")
    offload.check(cfg)
    check_zero(cfg, (2, 3))
    if p.zero >= 2 and p.pp > 1:
        raise ConfigError(
            f"parallel.zero = {p.zero} with parallel.pp = {p.pp} is not available in this version of plait; "
            "set parallel.zero=0 (gradients are then averaged over dp by an all-reduce)")


def transform(model: nn.Module, b: Build) -> nn.Module:
    p = b.cfg.parallel
    offload = p.offload == "params" and b.rt.device.type != "cpu"
    return apply_fsdp(model, b.rt.mesh["dp"], p.zero, param_dtype=b.cfg.precision.dtype, offload=offload)


def build(b: Build) -> Strategy:
    if b.cfg.parallel.offload != "none" and b.rt.device.type == "cpu":
        b.rt.print(f"note: parallel.offload = {b.cfg.parallel.offload!r} has no effect on a CPU run (the shards already "
                   "live in CPU memory)")
    model = b.parallelize(b.module)
    init = b.materialize(model)  # shard-only initialisation: the single-process values, this rank's shards only
    # FSDP2 casts parameters itself (its mixed-precision policy); autocast would be redundant.
    precision = Precision("fp32", b.rt.device) if b.cfg.precision.dtype == "bf16" else b.precision
    strategy = FSDPStrategy(model, b.module, b.make_optimizer(b.module), b.loss_fn, precision, b.local_batch,
                            stage=b.cfg.parallel.zero)
    strategy.tensor_parallel = b.rt.axis_size("tp") > 1
    strategy.init_memory = init
    return strategy


SCHEME = Scheme("fsdp", applies=lambda cfg: cfg.parallel.dp > 1 and cfg.parallel.zero >= 2, check=check,
                transform=transform, strategy=build)
