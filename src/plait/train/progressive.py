"""Progressive freezing in the training loop: the schedule of plait.finetune.progressive, as a callback.

    freezer = Freezer(ProgressiveFreeze(strategy.module, steps, start), strategy)
    freezer.on_step_begin(done)   # freezes what is due; records {"step", "frozen_blocks", "froze"} per block

A resumed run freezes what the checkpoint's step had frozen before loading it (on_resume): the optimizer
then holds exactly the parameters whose state the checkpoint has.

When blocks freeze, the strategy stops training their parameters (Strategy.stop_training): they leave the
optimizer and, at dp > 1, DDP is rebuilt over the parameters that still train. The schedule depends on
the step alone, so every rank freezes at the same step. Under ZeRO-2/3 FSDP2's unsharded copies stop requiring a
gradient too (plait.parallel.fsdp); ZeRO-1 is refused (plait.finetune.transforms.check_layout).
"""

from __future__ import annotations

from plait.callback import Callback
from plait.finetune.progressive import ProgressiveFreeze


class Freezer(Callback):
    """What is frozen follows from the step alone: no state of its own in the checkpoint."""

    def __init__(self, plan: ProgressiveFreeze, strategy):
        self.plan, self.strategy = plan, strategy
        self.events: list[dict] = []  # one record per block frozen so far
        self.start = 0

    @property
    def frozen(self) -> int:
        return self.plan.frozen

    def fields(self) -> dict:
        """For every metrics record: how many blocks are frozen."""
        return {"frozen_blocks": self.plan.frozen}

    def on_resume(self, step: int) -> None:
        self.update(step)  # blocks frozen by the checkpoint's step have no optimizer state in it

    def on_train_begin(self, step: int) -> list[dict]:
        self.start = step
        self.update(step)  # what is due by `step`, frozen now
        return [e for e in self.events if e["step"] >= step]  # blocks frozen before this session that no session wrote

    def on_step_begin(self, step: int) -> list[dict]:
        return self.update(step) if step > self.start else []

    def update(self, done: int) -> list[dict]:
        """Freeze what is due once `done` steps are done; returns one record per block frozen now."""
        before = self.plan.frozen
        newly = self.plan.advance(done)
        if self.plan.frozen == before:
            return []
        self.strategy.stop_training([p for _, p in newly])
        new = [{"step": self.plan.at[i], "frozen_blocks": i + 1, "froze": name}
               for i, name in enumerate(self.plan.names(self.plan.frozen)) if i >= before]
        self.events += new
        return new
