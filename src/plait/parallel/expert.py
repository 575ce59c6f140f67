"""Expert parallel (`parallel.ep = K`): each MoE layer's E experts spread over K data-parallel ranks, E/K on each.

The ep axis reuses data-parallel ranks, as DeepSpeed-MoE and torchtitan do: the dp ranks are cut
into a (dp/K, K) mesh,

    ep          K consecutive ranks that split the experts between them (one all-to-all group; consecutive,
                so it stays on a machine's fastest links when it can)
    ep_replica  the dp/K ranks that hold the same experts (one per ep group)

and one step is

    forward     each MoE layer sends its tokens to their experts' ranks and back (plait.models.moe)
    dense part  data parallel as without experts: DDP (zero = 0) or FSDP2 (zero = 2, 3), experts left out
    experts     after backward, summed over ep_replica and divided by dp

Why divide by dp and not by the dp/K replicas: rank r's loss L_r is its share of the global mean
L = (1/dp) sum_r L_r, so a dense gradient is averaged over dp. Expert e processed the tokens of
every rank of its ep group, so after backward its gradient is already sum_{s in group} dL_s/de;
the sum over the replicas is then sum_{all dp ranks} dL_s/de, and dL/de is that divided by dp.

The expert weights become DTensors (Replicate over ep_replica, Shard(0) over ep) under the plain
model's names. That gives the rest for free: DCP writes each expert once with its global offsets
and reads it back at any ep (1 included, and back), full_model_state_dict gathers them, the
summary counts the model's parameters and the memory figures this rank's E/K share, and the
global gradient norm counts each expert once (its norm is reduced over the ep group,
plait.parallel.gradsync). Routing and the load-balancing loss are computed on each token's own
rank, so they are what one process computes.

ZeRO: stages 2 and 3 shard the dense part (FSDP2, the experts its ignored parameters); stage 1 is
refused (its flat buffers would take the experts in). Activation checkpointing composes: the
recomputed forward repeats its all-to-alls, every rank recomputing the same blocks in the same order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from plait.comm.compression import ratio_metrics
from plait.models.moe import MoE, moe_layers
from plait.parallel.base import Strategy
from plait.parallel.ddp import rebuilt
from plait.parallel.ddp import transform as ddp_transform
from plait.parallel.fsdp import apply_fsdp, stop_unsharded
from plait.parallel.gradsync import allreduce_grads
from plait.parallel.scheme import Build


def shard_experts(model: nn.Module, mesh) -> list[str]:
    """Keep this rank's E/K experts of every MoE layer (DTensors on `mesh`) and route over its ep group; their names."""
    ep = mesh["ep"]
    k, rank = ep.size(), ep.get_local_rank()
    names = []
    for prefix, layer in model.named_modules():
        if not isinstance(layer, MoE):
            continue
        n = layer.experts // k
        for name in layer.expert_params:
            # Every rank starts from the same full weights (same seed): slicing needs no communication.
            whole = getattr(layer, name)
            local = whole.detach()[rank * n:(rank + 1) * n].clone()
            dt = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False)
            setattr(layer, name, nn.Parameter(dt, requires_grad=whole.requires_grad))  # frozen experts stay frozen
            names.append(f"{prefix}.{name}" if prefix else name)
        layer.set_expert_parallel(ep.get_group())
    return names


class ExpertParallelStrategy(Strategy):
    sharded = True  # expert gradients differ between ranks (the step's clip and norm see them whole, via DTensor)

    def __init__(self, *args, experts: list, replica_group, dp: int, ep: int, zero: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.experts, self.replica_group, self.dp = experts, replica_group, dp
        self.name = f"ep{ep}+" + (f"zero{zero}" if zero else "ddp")
        self.rewrap: Callable[[nn.Module], nn.Module] | None = None  # the plain model -> a new DDP over the dense part

    def no_sync(self):
        if isinstance(self.model, DDP):
            return self.model.no_sync()
        return _fsdp_no_sync(self.model)

    def step_metrics(self, record: dict) -> dict:
        """With compression of the dense part's DDP all-reduce: its uncompressed bytes per step and the ratio."""
        return ratio_metrics(getattr(self.model, "plait_compression", None), record)

    def stop_training(self, params: list) -> None:
        """Progressive freezing: as the base; the dense part's DDP rebuilt over what still trains (it lays its buckets
        out once), or FSDP2's unsharded copies frozen too. Frozen experts get no gradient: their replica average
        (after_backward) skips them."""
        super().stop_training(params)
        if isinstance(self.model, DDP):
            self.model = rebuilt(self.model, self.module, self.rewrap)
        else:
            stop_unsharded(self.model, params)

    def after_backward(self) -> None:
        # The replicas' sum over dp (see the module docstring): one flat all-reduce over ep_replica.
        allreduce_grads(self.experts, self.replica_group, self.dp)


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def transform(model: nn.Module, b: Build) -> nn.Module:
    names = shard_experts(model, b.rt.expert_mesh)
    # DDP (zero = 0, applied after this transform) then averages the dense part alone.
    DDP._set_params_and_buffers_to_ignore_for_model(model, names)
    return model


def build(b: Build) -> Strategy:
    layout = b.layout
    # This transform, activation checkpointing, compile and DDP in SCHEMES order; FSDP2 below, told about the experts.
    model = b.parallelize(b.module, skip=("fsdp",))
    experts = [getattr(layer, name) for layer in moe_layers(b.module) for name in layer.expert_params]
    if layout.shards_gradients:
        offload = layout.offload != "none" and b.rt.device.type != "cpu"
        model = apply_fsdp(model, b.rt.mesh["dp"], layout.zero, b.cfg.precision.dtype, offload,
                           ignored_params=set(experts))
    strategy = ExpertParallelStrategy(model, b.module, b.make_optimizer(b.module), b.loss_fn, b.precision,
                                      b.local_batch, experts=experts,
                                      replica_group=experts[0].device_mesh["ep_replica"].get_group(),
                                      dp=layout.dp, ep=layout.ep, zero=layout.zero)
    if isinstance(model, DDP):
        strategy.rewrap = lambda module: ddp_transform(module, b)
    return strategy
