"""ZeRO stage 1: optimizer states sharded over the dp axis (Rajbhandari et al., 2020, "P_os").

Every rank keeps the full parameters and gradients; each parameter is *owned* by one
rank (whole tensors, assigned greedily by size so the shards balance), and only the
owner keeps its optimizer state and updates it. One step moves what the paper says
plain data parallelism moves, 2 Psi:

    backward            gradients accumulate in place into a flat buffer, owners' segments
                        laid out rank after rank (each padded to the same length S)
    reduce-scatter      each rank receives the averaged gradients of the parameters it owns
    optimizer step      on owned parameters only (AdamW/SGD are elementwise: same result)
    all-gather          every rank receives the updated parameters of all owners

Parameters and gradients are views into the two flat buffers, so both collectives run
in place and no second copy of either exists. torch's ZeroRedundancyOptimizer would
keep DDP's all-reduce and add broadcasts (3 Psi); this is the paper's schedule.

Checkpoints stay layout-free: optimizer state is keyed by parameter name and written by
its owner, so a ZeRO-1 checkpoint loads at zero=0 and the other way round.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from plait.comm.compression import BY_HAND, Compression, CompressionState, compressed_average, ratio_metrics
from plait.comm.placement import balanced_owners
from plait.parallel.base import Strategy
from plait.parallel.ddp import HALF
from plait.parallel.gradsync import clip_grads
from plait.parallel.keys import DDPKeys
from plait.parallel.scheme import Build


class ZeroOneStrategy(Strategy):
    name = "zero1"
    sharded = True

    def __init__(self, module: nn.Module, make_optimizer, loss_fn, precision, local_batch: int, dp_group):
        self.group = dp_group
        self.ranks = dist.get_world_size(dp_group)
        self.rank = dist.get_rank(dp_group)
        params = [p for p in module.parameters() if p.requires_grad]  # unique (tied weights once)
        self.params = params
        owner = balanced_owners([p.numel() for p in params], self.ranks)
        loads = [sum(p.numel() for p, o in zip(params, owner) if o == r) for r in range(self.ranks)]
        self.segment = max(loads)  # S: every rank's segment is padded to this length
        ref = params[0]
        self.flat_params = torch.zeros(self.segment * self.ranks, dtype=ref.dtype, device=ref.device)
        self.flat_grads = torch.zeros_like(self.flat_params)
        fill = [r * self.segment for r in range(self.ranks)]
        with torch.no_grad():
            for p, o in zip(params, owner):
                n = p.numel()
                view = self.flat_params[fill[o]:fill[o] + n].view_as(p)
                view.copy_(p)
                p.data = view
                p.grad = self.flat_grads[fill[o]:fill[o] + n].view_as(p)
                fill[o] += n
        self.compress: torch.dtype | None = None  # parallel.compression = fp16 | bf16: the reduce-scatter's dtype
        self.sparse: CompressionState | None = None  # parallel.compression = topk | int8 | powersgd
        self.owned = [p for p, o in zip(params, owner) if o == self.rank]
        self.owned_numel = loads[self.rank]
        optimizer = make_optimizer(module, only=set(map(id, self.owned)))
        super().__init__(module, module, optimizer, loss_fn, precision, local_batch)

    def forward_backward(self, micro_batches) -> torch.Tensor:
        loss = super().forward_backward(micro_batches)
        lo = self.rank * self.segment
        if self.sparse is not None:  # top-k / int8: the whole flat buffer averaged by the scheme, this rank's segment kept
            mean = compressed_average(self.sparse, self.flat_grads, reduce_scatter=True,
                                      views=[p.grad for p in self.params if p.grad is not None])  # PowerSGD: matrices
            self.flat_grads[lo:lo + self.segment].copy_(mean[lo:lo + self.segment])
            return loss
        if self.compress is not None:  # fp16/bf16 compression: cast, divide, reduce-scatter in that dtype, cast back
            half = self.flat_grads.to(self.compress).div_(self.ranks)
            mine = torch.empty(self.segment, dtype=self.compress, device=half.device)
            dist.reduce_scatter_single(mine, half, group=self.group)
            self.flat_grads[lo:lo + self.segment].copy_(mine)
            return loss
        # In place: the output is this rank's own segment of the input buffer.
        dist.reduce_scatter_single(self.flat_grads[lo:lo + self.segment], self.flat_grads, group=self.group)
        self.flat_grads[lo:lo + self.segment].div_(self.ranks)
        return loss

    def step_metrics(self, record: dict) -> dict:
        """With top-k / int8 compression: the uncompressed bytes per step and the ratio to the bytes sent."""
        return ratio_metrics(self.sparse, record)

    def clip_grad_norm(self, max_norm: float, need_norm: bool = True) -> torch.Tensor | None:
        """Global gradient norm from the owned (already averaged) segments; clips owned gradients."""
        self.precision.unscale(self.optimizer, self.group)
        if max_norm <= 0 and not need_norm:
            return None
        # Per owned tensor (their gradients are views of this rank's averaged segment), as torch's clip does:
        # one float32 norm over a whole segment loses precision as the segment grows.
        return clip_grads([], max_norm, partial=[p.grad for p in self.owned if p.grad is not None], group=self.group)

    def stop_training(self, params: list) -> None:
        """Progressive freezing: out of the owner's optimizer, their state dropped. Their gradients stay views of the
        flat buffer (frozen, autograd adds nothing to them: zeros are reduce-scattered and all-gathered unchanged, the
        traffic is the same; the flat buffers are laid out once)."""
        self.drop_from_optimizer(params)

    def state_dict(self) -> dict:
        self._init_optimizer_state()
        return super().state_dict()

    @torch.no_grad()
    def _init_optimizer_state(self) -> None:
        """Create the optimizer's state (a zero-gradient step at lr 0) before the first step, for a load to fill.

        DCP does this itself only when no parameter has a gradient, and here every one always has (views
        of the flat buffer): without it a resumed run's template held no optimizer state and AdamW restarted
        from zero moments.
        """
        if self.optimizer.state:
            return
        grads = self.flat_grads.clone()
        self.flat_grads.zero_()
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        self.optimizer.step()  # lr 0, gradients 0: the parameters do not move
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self.flat_grads.copy_(grads)

    def optimizer_step(self) -> None:
        self.precision.step(self.optimizer)
        lo = self.rank * self.segment
        dist.all_gather_single(self.flat_params, self.flat_params[lo:lo + self.segment], group=self.group)
        self.flat_grads.zero_()  # gradients are views into this buffer: zero it, never drop them


def build(b: Build) -> Strategy:
    strategy = ZeroOneStrategy(b.module, b.make_optimizer, b.loss_fn, b.precision, b.local_batch, b.rt.axis_group("dp"))
    keys = b.keys(DDPKeys)
    strategy.compress = HALF.get(keys.compression)
    if keys.compression in BY_HAND:
        strategy.sparse = CompressionState(b.rt.axis_group("dp"), Compression.from_keys(keys))
    strategy.model = b.parallelize(b.module)  # activation checkpointing / compile, after the flat buffers exist
    if keys.compression != "none":
        strategy.labels.append(f"{keys.compression} compression")
    return strategy
