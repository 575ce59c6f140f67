"""Data parallel with all-reduce: torch's DistributedDataParallel over the mesh's dp axis."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from plait.parallel.base import Strategy


def apply_ddp(model: nn.Module, dp_mesh, device) -> DDP:
    """Wrap the model in DDP on the dp axis's process group (gradients averaged across replicas).

    The all-reduce goes through torch's Python default hook (the same average as DDP's built-in
    one) so that plait.comm.accounting sees, and counts, every bucket.
    """
    group = dp_mesh.get_group()
    ddp = DDP(
        model,
        process_group=group,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )
    ddp.register_comm_hook(group, default_hooks.allreduce_hook)
    return ddp


class DDPStrategy(Strategy):
    name = "ddp"

    def no_sync(self):
        return self.model.no_sync()
