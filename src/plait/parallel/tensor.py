"""The step owner for tensor-parallel layouts (without a pipeline): DTensor-aware clipping, dp by hand."""

from __future__ import annotations

from plait.parallel.base import Strategy
from plait.parallel.gradsync import align_grads, allreduce_grads, clip_grad_norm


class TensorParallelStrategy(Strategy):
    name = "tp"

    def __init__(self, *args, rt, **kwargs):
        super().__init__(*args, **kwargs)
        self.rt = rt
        self.dp_group, self.dp = rt.axis_group("dp"), rt.axis_size("dp")

    def after_backward(self) -> None:
        align_grads(self.module.parameters())
        if self.dp > 1 and not hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2 reduces on its own
            allreduce_grads(self.module.parameters(), self.dp_group, self.dp)

    def clip_grad_norm(self, max_norm: float):
        self.precision.unscale(self.optimizer, self.rt.axis_group("tp"))
        if max_norm <= 0:
            return None
        return clip_grad_norm(self.module.parameters(), max_norm)
