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

from plait.parallel.base import DTYPES, Strategy


def apply_fsdp(model: nn.Module, dp_mesh, stage: int, param_dtype: str = "fp32", offload: bool = False) -> nn.Module:
    """Shard each of model.blocks, then the root; stage 3 reshards after forward, stage 2 does not."""
    from plait.parallel import _blocks

    mp = None
    if param_dtype != "fp32":
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)
    kwargs = {"mesh": dp_mesh, "reshard_after_forward": stage == 3}
    if mp is not None:
        kwargs["mp_policy"] = mp
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in _blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


class FSDPStrategy(Strategy):
    name = "fsdp"

    def __init__(self, *args, stage: int, dp_group, tensor_parallel: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.tensor_parallel = tensor_parallel
        self.name = f"zero{stage}"
        self.group = dp_group

    @contextlib.contextmanager
    def no_sync(self):
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def clip_grad_norm(self, max_norm: float):
        self.precision.unscale(self.optimizer, self.group)
        if max_norm <= 0:
            return None
        if self.tensor_parallel:  # parameters on two meshes (dp x tp and dp): clip them one by one
            from plait.parallel.gradsync import clip_grad_norm

            return clip_grad_norm(self.module.parameters(), max_norm)
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
