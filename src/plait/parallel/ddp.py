"""Data parallel with all-reduce: torch's DistributedDataParallel over the mesh's dp axis."""

from __future__ import annotations

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from plait.parallel.base import Strategy


def apply_ddp(model: nn.Module, dp_mesh, device) -> DDP:
    """Wrap the model in DDP on the dp axis's process group (gradients averaged across replicas)."""
    return DDP(
        model,
        process_group=dp_mesh.get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )


class DDPStrategy(Strategy):
    name = "ddp"

    def no_sync(self):
        return self.model.no_sync()
