"""Features of the training loop as callbacks: each owns its policy and its state, stored in the checkpoint.

    class MyFeature(Callback):
        name = "my_feature"                         # its key in the checkpoint's trainer_state.json
        def on_step_end(self, step): ...            # events (dicts with "step") for metrics.jsonl, or None
        def state_dict(self): ...                   # plain JSON data; load_state_dict(state) on resume

The loop (plait.train.loop) calls every hook of every callback in order; none is required. Hooks:

    on_resume(step)                   before the checkpoint of `step` loads (progressive freezing freezes what it
                                      had frozen, so the optimizer holds exactly what the checkpoint has)
    on_train_begin(step)              the session starts after `step` steps; events
    on_step_begin(step)               before step step + 1 (`step` steps done): learning rate, dropout seed, freezing
    after_compute(step, seconds, samples)   inside forward/backward: this rank's compute time (a slow-device fault
                                      sleeps here; hetero measures it)
    on_step_end(step)                 after the optimizer step; events
    on_eval(step, metrics)            after an evaluation: a Decision (save, mark this checkpoint best, stop)
    fields()                          extra fields for every metrics record
    summary(step, final)              entries for summary.json, given the final evaluation's metrics
    on_train_end(step, checkpointer)  the session ended normally at `step`

Decisions are data (plait.train.callbacks.Decision) merged over the callbacks; every rank sees the same
evaluation (its metrics are reduced over the ranks), so every rank decides the same.
"""

from __future__ import annotations

import torch

from plait.callback import Callback, Callbacks, Decision
from plait.runtime import mix_seed
from plait.train.keys import EARLY_STOP_METRICS as METRICS
from plait.train.optim import lr_at, set_lr

__all__ = ["Best", "Callback", "Callbacks", "Decision", "DropoutSeed", "EarlyStop", "EarlyStopping", "KeepBest",
           "LearningRate", "PatchSteps"]


# ---------------------------------------------------------------------------------------------- decisions


class Best:
    """The best value of one evaluation metric so far, and the step it was reached at."""

    def __init__(self, metric: str, min_delta: float = 0.0):
        self.metric, self.min_delta, self.mode = metric, min_delta, METRICS[metric]
        self.value: float | None = None
        self.step: int | None = None

    def update(self, step: int, metrics: dict) -> bool:
        v = metrics.get(self.metric)
        if v is None:
            return False
        better = self.value is None or (v < self.value - self.min_delta if self.mode == "min"
                                        else v > self.value + self.min_delta)
        if better:
            self.value, self.step = float(v), step
        return better

    def state_dict(self) -> dict:
        return {"value": self.value, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.step = state["value"], state["step"]


class EarlyStop:
    """Stop when `patience` evaluations in a row have not improved `metric` by more than `min_delta`."""

    def __init__(self, metric: str = "val_loss", patience: int = 3, min_delta: float = 0.0):
        self.best, self.patience, self.waited = Best(metric, min_delta), patience, 0

    @classmethod
    def from_config(cls, spec: dict) -> EarlyStop | None:
        return cls(**spec) if spec else None

    def update(self, step: int, metrics: dict) -> bool:
        self.waited = 0 if self.best.update(step, metrics) else self.waited + 1
        return self.waited >= self.patience


# ---------------------------------------------------------------------------------------------- the callbacks


class KeepBest(Callback):
    """checkpoint.keep_best: the best evaluated checkpoint stays as checkpoints/best whatever pruning removes."""

    name = "keep_best"

    def __init__(self, metric: str):
        self.best = Best(metric)

    def on_eval(self, step: int, metrics: dict) -> Decision:
        better = self.best.update(step, metrics)
        return Decision(save=better, mark_best=better)

    def summary(self, step: int, final: dict) -> dict:
        self.best.update(step, final)  # the final evaluation may be the best
        b = self.best
        return {"best": {"metric": b.metric, "step": b.step, "value": b.value}}

    def on_train_end(self, step: int, checkpointer) -> None:
        if checkpointer is not None and self.best.step == step:
            checkpointer.mark_best(step)  # the final evaluation was the best

    def state_dict(self) -> dict:
        return self.best.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.best.load_state_dict(state)


class EarlyStopping(Callback):
    """train.early_stop: stop (checkpointing where it stops) once the metric has not improved for `patience`."""

    name = "early_stop"

    def __init__(self, spec: dict, log=print):
        self.rule = EarlyStop(**spec)
        self.log = log
        self.stopped: dict | None = None

    def on_eval(self, step: int, metrics: dict) -> Decision | None:
        if not self.rule.update(step, metrics):
            return None
        b = self.rule.best
        self.stopped = {"step": step, "metric": b.metric, "best_step": b.step, "best_value": b.value,
                        "patience": self.rule.patience}
        self.log(f"early stop at step {step}: {b.metric} has not improved on {b.value:.4g} (step {b.step}) for "
                 f"{self.rule.patience} evaluations")
        return Decision(save=True, stop=True, events=({"step": step, "event": "early_stop", **self.stopped},))

    def summary(self, step: int, final: dict) -> dict:
        return {"early_stop": self.stopped} if self.stopped else {}

    def state_dict(self) -> dict:
        return {"best": self.rule.best.state_dict(), "waited": self.rule.waited}

    def load_state_dict(self, state: dict) -> None:
        self.rule.best.load_state_dict(state["best"])
        self.rule.waited = int(state["waited"])


class LearningRate(Callback):
    """The learning rate of each step, from the schedule (optim.*) and the step alone."""

    def __init__(self, strategy, optim_cfg, steps: int, global_batch: int):
        self.strategy, self.cfg, self.steps, self.global_batch = strategy, optim_cfg, steps, global_batch

    def on_step_begin(self, step: int) -> None:
        set_lr(self.strategy.optimizer, lr_at(step, self.cfg, self.steps, self.global_batch))


class PatchSteps(Callback):
    """Patch gradient descent (plait.models.patchgd): the step whose patches the model draws, set before each step
    on every rank, so every micro-batch and rank of a step back-propagates through the same patches."""

    def __init__(self, module, seed: int):
        self.module, self.seed = module, seed

    def on_step_begin(self, step: int) -> None:
        self.module.seed, self.module.step = self.seed, step


class DropoutSeed(Callback):
    """Dropout masks from (seed, step, rank): exact on resume, statistical across layouts (model.dropout > 0)."""

    def __init__(self, seed: int, rank: int):
        self.seed, self.rank = seed, rank

    def on_step_begin(self, step: int) -> None:
        torch.manual_seed(mix_seed(self.seed, step, self.rank))
