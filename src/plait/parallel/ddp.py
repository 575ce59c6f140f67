"""Data parallel with all-reduce: torch's DistributedDataParallel over the mesh's dp axis.

A tensor-parallel model (DTensor parameters, which DDP does not take) is averaged over dp by hand:
one flat all-reduce after backward (fp16/bf16 compression: in that dtype). Compression (`parallel.compression`)
otherwise runs as a DDP comm hook, and
so does plait's own all-reduce (`parallel.allreduce = "ring" | "tree" | "hierarchical"`); the two do
not combine (a compression hook makes its own collectives).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel as DDP

from plait.comm.accounting import AlgorithmHookState, algorithm_hook, ddp_allreduce_hook
from plait.comm.compression import (
    BY_HAND,
    Compression,
    CompressionState,
    compressed_average,
    ratio_metrics,
    register_compression,
)
from plait.parallel.base import Strategy
from plait.parallel.gradsync import allreduce_grads
from plait.parallel.keys import DDPKeys
from plait.parallel.scheme import Build


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
    setattr(ddp, "plait_allreduce", {"allreduce": allreduce, "local_size": local_size})  # noqa: B010 (nn.Module attr)
    if compression is not None and compression.kind != "none":
        setattr(ddp, "plait_compression", register_compression(ddp, group, compression))  # noqa: B010 (nn.Module attr)
    elif allreduce != "native":
        local = local_size or int(os.environ.get("LOCAL_WORLD_SIZE", ddp.process_group.size()))
        ddp.register_comm_hook(AlgorithmHookState(group, allreduce, local), algorithm_hook)
    else:
        ddp.register_comm_hook(group, ddp_allreduce_hook)
    return ddp


def rebuilt(model: nn.Module, module: nn.Module, rewrap: Callable[[nn.Module], nn.Module] | None) -> nn.Module:
    """A DDP wrapper made again over what trains now (DDP lays its buckets out once); anything else as it was."""
    if not isinstance(model, DDP) or rewrap is None:
        return model
    model._remove_autograd_hooks()
    return rewrap(module)


HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}  # compressions a tensor-parallel model's by-hand average does


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(self, *args, dp_group=None, dp: int = 1, compress: torch.dtype | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.by_hand = not isinstance(self.model, DDP)  # a tensor-parallel model: averaged after backward
        self.dp_group, self.dp = dp_group, dp
        self.compress = compress  # by hand: fp16/bf16 compression of the dp all-reduce
        self.sparse: CompressionState | None = None  # by hand: top-k / int8 of the dp average (set by build)
        self.rewrap: Callable[[nn.Module], nn.Module] | None = None  # module -> a new DDP wrapper like this one
        self.sharded = self.by_hand
        if self.by_hand:
            self.name = "tp+dp"

    def no_sync(self):
        return contextlib.nullcontext() if self.by_hand else self.model.no_sync()

    def after_backward(self) -> None:
        super().after_backward()
        if self.by_hand and self.sparse is not None:  # top-k / int8 of this rank's shards, along dp only
            grads = [g.to_local() if hasattr(g, "to_local") else g for p in self.module.parameters()
                     if (g := p.grad) is not None]
            flat = _flatten_dense_tensors(grads)
            views = _unflatten_dense_tensors(flat, grads)  # views of flat: PowerSGD takes each shard as a matrix
            mean = compressed_average(self.sparse, flat, views=views)
            for g, m in zip(grads, _unflatten_dense_tensors(mean, grads)):
                g.copy_(m)
        elif self.by_hand:
            allreduce_grads(self.module.parameters(), self.dp_group, self.dp, self.compress)

    def stop_training(self, params: list) -> None:
        """As the base, then DDP rebuilt over the parameters that still train (it lays its buckets out once, from the
        parameters that require a gradient, so the rebuilt one sends only what trains). A collective: every rank
        freezes at the same step. A compression hook's state starts afresh."""
        super().stop_training(params)
        self.model = rebuilt(self.model, self.module, self.rewrap)

    def step_metrics(self, record: dict) -> dict:
        """With compression: the uncompressed all-reduce bytes per step and their ratio to the bytes sent."""
        return ratio_metrics(self.sparse or getattr(self.model, "plait_compression", None), record)


def transform(model: nn.Module, b: Build) -> nn.Module:
    if b.rt.axis_size("tp") > 1:
        return model  # DTensors: averaged by hand in DDPStrategy.after_backward
    keys = b.keys(DDPKeys)
    return apply_ddp(model, b.rt.replica_mesh(), b.rt.device, Compression.from_keys(keys), allreduce=keys.allreduce,
                     local_size=keys.allreduce_local_size)


def build(b: Build, cls: type | None = None) -> Strategy:
    """The DDP strategy (cls: DDPStrategy or a subclass, such as a spread ensemble's)."""
    model = b.parallelize(b.module)
    compression = b.keys(DDPKeys).compression
    strategy = (cls or DDPStrategy)(model, b.module, b.make_optimizer(b.module), b.loss_fn, b.precision,
                                    b.local_batch, dp_group=b.rt.axis_group("dp"), dp=b.rt.axis_size("dp"),
                                    compress=HALF.get(compression))
    strategy.tensor_parallel = b.rt.axis_size("tp") > 1
    if strategy.by_hand and compression in BY_HAND:
        strategy.sparse = CompressionState(b.rt.axis_group("dp"), Compression.from_keys(b.keys(DDPKeys)))
    strategy.rewrap = lambda module: transform(module, b)
    if compression != "none":
        strategy.labels.append(f"{compression} compression")
    return strategy
