"""ZeRO stages 2 and 3 with FSDP2 (`fully_shard`), sharded over the dp axis.

Stage 3 shards each block, then the root, and reshards parameters after forward (all-gathered
again for backward: 3 Psi per step). Stage 2 shards the root alone and keeps its parameters
unsharded from forward through backward: one all-gather before forward, one reduce-scatter
after backward (2 Psi per step, as ZeRO-1). Gradients are reduce-scattered and optimizer states
sharded in both. Parameters are sharded at rest in both as well, which FSDP2 does not let us
avoid; it only lowers stage 2's memory.

The gradient norm and the optimizer step work on the DTensors' local shards (plain tensors):
the same elementwise arithmetic without DTensor's dispatch on every op, and the norm's one
all-reduce is a torch.distributed call that plait.comm.accounting counts.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from plait.errors import ConfigError
from plait.parallel.base import DTYPES, Precision, Strategy, model_blocks
from plait.parallel.gradsync import clip_grads
from plait.parallel.scheme import Build, Scheme

# Optimizers whose update is elementwise, so that a step on a shard equals that shard of the full step.
SHARDABLE_OPTIMIZERS = ("adamw", "sgd")


def apply_fsdp(model: nn.Module, dp_mesh, stage: int, param_dtype: str = "fp32", offload: bool = False,
               ignored_params: set | None = None) -> nn.Module:
    """Stage 3: shard each of model.blocks, then the root, resharding after forward; stage 2: the root alone, kept whole.

    ignored_params stay as they are (expert parallel keeps its experts out and synchronises them itself)."""
    mp = None
    if param_dtype != "fp32":
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)
    kwargs = {"mesh": dp_mesh, "reshard_after_forward": stage == 3, "ignored_params": ignored_params}
    if mp is not None:
        kwargs["mp_policy"] = mp
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    # Stage 2 holds every parameter whole from forward through backward anyway: one group (the root) makes
    # it one all-gather and one reduce-scatter a step, not one per block, and skips the blocks' hooks.
    for block in model_blocks(model) if stage == 3 else []:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


class FSDPStrategy(Strategy):
    name = "fsdp"
    sharded = True

    def __init__(self, *args, stage: int, dp_group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.name = f"zero{stage}"
        self.dp_group = dp_group

    @contextlib.contextmanager
    def no_sync(self):
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def _dp_shards(self) -> list | None:
        """The parameters, when every one is a DTensor sharded over the dp axis alone (no tp, no ignored params)."""
        if self.dp_group is None or self.tensor_parallel:
            return None
        params = [p for p in self.module.parameters() if p.requires_grad]
        if all(isinstance(p, DTensor) and p.device_mesh.ndim == 1 for p in params):
            return params
        return None

    def clip_grad_norm(self, max_norm: float, need_norm: bool = True) -> torch.Tensor | None:
        """As the base, from the local gradient shards: one counted all-reduce of a float64 scalar, no DTensor ops."""
        params = self._dp_shards()
        if params is None:
            return super().clip_grad_norm(max_norm, need_norm)
        self.precision.unscale(self.optimizer, self.overflow_group())
        if max_norm <= 0 and not need_norm:
            return None
        return clip_grads([], max_norm, partial=[p.grad._local_tensor for p in params if p.grad is not None],
                          group=self.dp_group)

    def optimizer_step(self) -> None:
        params = self._dp_shards()
        if (params is None or self.precision.scaler is not None or type(self.optimizer) not in LOCAL_STEP
                or any(p not in self.optimizer.state for p in params if p.grad is not None)):
            super().optimizer_step()  # the first step creates the state (as DTensors) through the optimizer itself
            return
        with _on_local_shards(self.optimizer):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


# Elementwise optimizers stepped on the local shards of FSDP2's DTensors: the same arithmetic on the same
# numbers, without DTensor's dispatch on every one of the step's dozens of ops per parameter.
LOCAL_STEP = (torch.optim.AdamW, torch.optim.SGD)


@contextlib.contextmanager
def _on_local_shards(optimizer: torch.optim.Optimizer):
    """While open, the optimizer's parameters, gradients and state are the DTensors' local tensors.

    Every parameter must have its state already: the local tensors are views, so the step's in-place
    updates land in the DTensors, whose state dicts come back as they were."""
    swapped, states = [], {}
    for group in optimizer.param_groups:
        swapped.append(group["params"])
        local = []
        for p in group["params"]:
            q = p._local_tensor
            q.grad = p.grad._local_tensor if p.grad is not None else None
            if p in optimizer.state:
                states[q] = (p, optimizer.state.pop(p))
                optimizer.state[q] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in states[q][1].items()}
            local.append(q)
        group["params"] = local
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, swapped):
            for q in group["params"]:
                q.grad = None
                if q in states:
                    p, state = states[q]
                    optimizer.state[p] = state
                    del optimizer.state[q]
            group["params"] = params


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
                            stage=b.cfg.parallel.zero, dp_group=b.rt.axis_group("dp"))
    strategy.tensor_parallel = b.rt.axis_size("tp") > 1
    strategy.init_memory = init
    return strategy


SCHEME = Scheme("fsdp", applies=lambda cfg: cfg.parallel.dp > 1 and cfg.parallel.zero >= 2, check=check,
                transform=transform, strategy=build)
