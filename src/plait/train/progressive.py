"""Progressive freezing in the training loop: the schedule of plait.finetune.progressive, applied to a Strategy.

    freezer = Freezer.build(cfg, strategy, rt)   # None unless finetune.progressive_freeze
    events = freezer.update(done)                # before each step; records {"step", "frozen_blocks", "froze"}

A resumed run calls update(checkpoint step) before loading the checkpoint: the optimizer then holds
exactly the parameters whose state the checkpoint has.

When blocks freeze, their parameters leave the optimizer (their state is dropped) and, at dp > 1, DDP
is rebuilt over the parameters that still train: DDP lays its buckets out once, from the parameters
that require a gradient, so the rebuilt one sends only what trains. A rebuild is a collective (every
rank freezes at the same step, the schedule depends on the step alone) and starts a compression hook's
state afresh. ZeRO is refused by plait.finetune.progressive.check.
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel as DDP

from plait.comm.compression import Compression
from plait.finetune.progressive import ProgressiveFreeze
from plait.parallel.ddp import apply_ddp


class Freezer:
    def __init__(self, plan: ProgressiveFreeze, strategy, rt, compression: Compression | None):
        self.plan, self.strategy, self.rt, self.compression = plan, strategy, rt, compression
        self.events: list[dict] = []  # one record per block frozen so far

    @classmethod
    def build(cls, cfg, strategy, rt) -> Freezer | None:
        f = cfg.finetune
        if not f.progressive_freeze:
            return None
        plan = ProgressiveFreeze(strategy.module, cfg.train.steps, f.progressive_freeze_start)
        return cls(plan, strategy, rt, Compression.from_config(cfg.parallel))

    @property
    def frozen(self) -> int:
        return self.plan.frozen

    def fields(self) -> dict:
        """For every metrics record: how many blocks are frozen."""
        return {"frozen_blocks": self.plan.frozen}

    def update(self, done: int) -> list[dict]:
        """Freeze what is due once `done` steps are done; returns one record per block frozen now."""
        before = self.plan.frozen
        newly = self.plan.advance(done)
        if self.plan.frozen == before:
            return []
        ids = {id(p) for _, p in newly}
        opt = self.strategy.optimizer
        for group in opt.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in ids]
        for _, p in newly:
            opt.state.pop(p, None)
            p.grad = None
        if isinstance(self.strategy.model, DDP):
            old = self.strategy.model
            old._remove_autograd_hooks()
            self.strategy.model = apply_ddp(self.strategy.module, self.rt.mesh["dp"], self.rt.device, self.compression,
                                            **getattr(old, "plait_allreduce", {}))
            del old
        new = [{"step": self.plan.at[i], "frozen_blocks": i + 1, "froze": name}
               for i, name in enumerate(self.plan.names(self.plan.frozen)) if i >= before]
        self.events += new
        return new
