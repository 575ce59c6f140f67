"""Data parallel with all-reduce: torch's DistributedDataParallel over the mesh's dp axis."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from plait.comm.compression import Compression, register_compression
from plait.parallel.base import Strategy


def apply_ddp(model: nn.Module, dp_mesh, device, compression: Compression | None = None) -> DDP:
    """Wrap the model in DDP on the dp axis's process group (gradients averaged across replicas).

    The all-reduce goes through torch's Python default hook (the same average as DDP's built-in
    one) so that plait.comm.accounting sees, and counts, every bucket. With `compression` the hook
    is plait.comm.compression's instead; its state is kept as `ddp.plait_compression`.
    """
    group = dp_mesh.get_group()
    ddp = DDP(
        model,
        process_group=group,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )
    if compression is not None and compression.kind != "none":
        ddp.plait_compression = register_compression(ddp, group, compression)
    else:
        ddp.register_comm_hook(group, default_hooks.allreduce_hook)
    return ddp


class DDPStrategy(Strategy):
    name = "ddp"

    def no_sync(self):
        return self.model.no_sync()

    def step_metrics(self, record: dict) -> dict:
        """With compression: the uncompressed all-reduce bytes per step and their ratio to the bytes sent."""
        state = getattr(self.model, "plait_compression", None)
        if state is None:
            return {}
        raw, steps = state.take()
        raw /= max(1, steps)
        sent = record.get("comm_bytes") or 0.0
        return {"uncompressed_bytes": raw, "compression_ratio": raw / sent if sent else None}
