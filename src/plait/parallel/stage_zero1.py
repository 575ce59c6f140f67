"""ZeRO-1 inside pipeline stages (parallel.zero = 1 with pp > 1): each stage's optimizer state sharded over the
stage's dp ranks.

The stage's gradients are averaged over dp as without ZeRO (every rank holds them whole, as ZeRO-1 allows), each
parameter that trains has one owner among the dp ranks (whole tensors, balanced by size, as plait.parallel.zero
does), a rank's optimizer steps only what it owns, and each owner then broadcasts its updated parameters to the
stage's other dp ranks. Optimizer state per rank: about 1/dp of the stage's; the price is that broadcast (the
stage's parameters once a step) on top of the gradient all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from plait.comm.placement import balanced_owners


class StageOwners:
    """Which dp rank of a stage steps which of its parameters, and the broadcast that shares the result."""

    def __init__(self, module: nn.Module, dp_group):
        self.group = dp_group
        params = [p for p in module.parameters() if p.requires_grad]  # unique (a tied weight once)
        ranks = dist.get_world_size(dp_group)
        owner = balanced_owners([p.numel() for p in params], ranks)
        self.by_owner = [[p for p, o in zip(params, owner) if o == r] for r in range(ranks)]
        self.mine = {id(p) for p in self.by_owner[dist.get_rank(dp_group)]}

    @torch.no_grad()
    def share(self) -> None:
        """Every owner's updated parameters to the stage's other dp ranks (one broadcast per owner)."""
        for r, params in enumerate(self.by_owner):
            params = [p for p in params if p.requires_grad]  # a frozen one (progressive freezing) no longer moves
            if not params:
                continue
            flat = _flatten_dense_tensors([p.detach() for p in params])
            dist.broadcast(flat, src=dist.get_global_rank(self.group, r), group=self.group)
            for p, value in zip(params, _unflatten_dense_tensors(flat, params)):
                p.copy_(value)
