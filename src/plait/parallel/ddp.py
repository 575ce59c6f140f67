"""Data parallel with all-reduce: torch's DistributedDataParallel over the mesh's dp axis.

A tensor-parallel model (DTensor parameters, which DDP does not take) is averaged over dp by hand:
one flat all-reduce after backward. Compression (`parallel.compression`) runs as a DDP comm hook, and
so does plait's own all-reduce (`parallel.allreduce = "ring" | "tree" | "hierarchical"`); the two do
not combine (a compression hook makes its own collectives).
"""

from __future__ import annotations

import contextlib
import os

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from plait.comm.accounting import AlgorithmHookState, algorithm_hook, ddp_allreduce_hook
from plait.comm.compression import Compression, register_compression
from plait.errors import ConfigError
from plait.parallel import hetero
from plait.parallel.base import Strategy
from plait.parallel.gradsync import allreduce_grads
from plait.parallel.scheme import Build, Scheme


def apply_ddp(model: nn.Module, dp_mesh, device, compression: Compression | None = None,
              allreduce: str = "native", local_size: int = 0) -> DDP:
    """Wrap the model in DDP on the dp axis's process group (gradients averaged across replicas).

    The all-reduce goes through a Python hook (the same average as DDP's built-in one) so that
    plait.comm.accounting sees, counts and times every bucket. With `compression` the hook is
    plait.comm.compression's instead; its state is kept as `ddp.plait_compression`. With `allreduce`
    other than "native" each bucket is summed by that plait.comm.algorithms all-reduce (hierarchical:
    `local_size` consecutive ranks per node, 0 for LOCAL_WORLD_SIZE); the choice is kept as
    `ddp.plait_allreduce` for a rebuild of the wrapper.
    """
    group = dp_mesh.get_group()
    ddp = DDP(
        model,
        process_group=group,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )
    ddp.plait_allreduce = {"allreduce": allreduce, "local_size": local_size}
    if compression is not None and compression.kind != "none":
        ddp.plait_compression = register_compression(ddp, group, compression)
    elif allreduce != "native":
        local = local_size or int(os.environ.get("LOCAL_WORLD_SIZE", ddp.process_group.size()))
        ddp.register_comm_hook(AlgorithmHookState(group, allreduce, local), algorithm_hook)
    else:
        ddp.register_comm_hook(group, ddp_allreduce_hook)
    return ddp


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(self, *args, dp_group=None, dp: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.by_hand = not isinstance(self.model, DDP)  # a tensor-parallel model: averaged after backward
        self.dp_group, self.dp = dp_group, dp
        self.sharded = self.by_hand
        if self.by_hand:
            self.name = "tp+dp"

    def no_sync(self):
        return contextlib.nullcontext() if self.by_hand else self.model.no_sync()

    def after_backward(self) -> None:
        super().after_backward()
        if self.by_hand:
            allreduce_grads(self.module.parameters(), self.dp_group, self.dp)

    def step_metrics(self, record: dict) -> dict:
        """With compression: the uncompressed all-reduce bytes per step and their ratio to the bytes sent."""
        state = getattr(self.model, "plait_compression", None)
        if state is None:
            return {}
        raw, steps = state.take()
        raw /= max(1, steps)
        sent = record.get("comm_bytes") or 0.0
        return {"uncompressed_bytes": raw, "compression_ratio": raw / sent if sent else None}


def applies(cfg) -> bool:
    p = cfg.parallel
    return p.dp > 1 and p.zero == 0 and p.sync == "allreduce" and p.embedding_sharding == "none" and p.pp == 1


def check(cfg) -> None:
    p = cfg.parallel
    hetero.check(cfg)
    if p.powersgd_rank < 1:
        raise ConfigError(f"parallel.powersgd_rank = {p.powersgd_rank} must be >= 1 (the rank of PowerSGD's "
                          "approximation, e.g. 2); set --set parallel.powersgd_rank=2")
    if not (0.0 < p.topk_ratio <= 1.0):
        raise ConfigError(f"parallel.topk_ratio = {p.topk_ratio} must be in (0, 1] (the share of gradient entries sent, "
                          "e.g. 0.01); set --set parallel.topk_ratio=0.01")
    layout = f"dp = {p.dp}, tp = {p.tp}, pp = {p.pp}, zero = {p.zero}"
    if p.allreduce_local_size < 0:
        raise ConfigError(f"parallel.allreduce_local_size = {p.allreduce_local_size} must be >= 0 (ranks per node for "
                          "allreduce = 'hierarchical'; 0: LOCAL_WORLD_SIZE); set --set parallel.allreduce_local_size=0")
    if p.allreduce != "native":
        if p.sync != "allreduce" or p.dp < 2 or p.tp > 1 or p.pp > 1 or p.zero or p.embedding_sharding != "none":
            raise ConfigError(
                f"parallel.allreduce = {p.allreduce!r} runs DDP's gradient all-reduce as a comm hook: it needs "
                f"parallel.sync = 'allreduce' and dp >= 2 with tp = pp = 1, zero = 0 and no embedding_sharding (here "
                f"sync = {p.sync!r}, {layout}); set parallel.allreduce='native' or change the layout")
        if p.compression != "none":
            raise ConfigError(
                f"parallel.allreduce = {p.allreduce!r} and parallel.compression = {p.compression!r} are both DDP comm "
                "hooks and a model takes one; set parallel.allreduce='native' (compression makes its own collectives) "
                "or parallel.compression='none'")
    if p.compression == "none":
        return
    if p.sync != "allreduce":
        raise ConfigError(
            f"parallel.compression = {p.compression!r} compresses the data-parallel all-reduce, but parallel.sync = "
            f"{p.sync!r} has none; set parallel.compression='none' or parallel.sync='allreduce'")
    if p.dp < 2 or p.tp > 1 or p.pp > 1 or p.zero or p.embedding_sharding != "none":
        raise ConfigError(
            f"parallel.compression = {p.compression!r} runs as a DDP communication hook: it needs parallel.dp >= 2 "
            f"with tp = pp = 1, zero = 0 and no embedding_sharding (here {layout}); set parallel.compression='none' "
            "or change the layout")


def transform(model: nn.Module, b: Build) -> nn.Module:
    if b.rt.axis_size("tp") > 1:
        return model  # DTensors: averaged by hand in DDPStrategy.after_backward
    p = b.cfg.parallel
    return apply_ddp(model, b.rt.mesh["dp"], b.rt.device, Compression.from_config(p), allreduce=p.allreduce,
                     local_size=p.allreduce_local_size)


def build(b: Build) -> Strategy:
    model = b.parallelize(b.module)
    strategy = DDPStrategy(model, b.module, b.make_optimizer(b.module), b.loss_fn, b.precision, b.local_batch,
                           dp_group=b.rt.axis_group("dp"), dp=b.rt.axis_size("dp"))
    strategy.tensor_parallel = b.rt.axis_size("tp") > 1
    return strategy


SCHEME = Scheme("ddp", applies=applies, check=check, transform=transform, strategy=build)
