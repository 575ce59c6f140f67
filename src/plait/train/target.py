"""train.target: the step, data and time at which a run first reaches a validation figure, and what it cost.

    train.target = {metric = "val_loss", value = 2.0}     # or {metric = "val_accuracy", value = 0.9}
    launch.device_hour_cost = 2.5                          # one device for one hour, in any currency

The first evaluation that reaches the value (val_loss at most it, val_accuracy at least it) records the step, the
samples (and tokens, for a language model) seen by then, the training wall time since the first step (every
session of a resumed run added up), the device-hours (wall time x processes, summed per session: an elastic
run's sizes each count) and their cost. It is a metrics.jsonl event, a line on the console, and `time_to_target` in
summary.json (`reached: false` when the run ends first); the report shows it and `plait runs compare` ranks runs by
it (DLS ch. 6's "time to convergence").
"""

from __future__ import annotations

import time
from collections.abc import Callable

from plait.callback import Callback, Decision
from plait.train.keys import EARLY_STOP_METRICS as METRICS


class TimeToTarget(Callback):
    name = "target"

    def __init__(self, spec: dict, samples_per_step: int, tokens_per_sample: int | None, world_size: int,
                 device_hour_cost: float = 0.0, log: Callable = print, clock: Callable[[], float] = time.perf_counter):
        self.metric, self.value = spec.get("metric", "val_loss"), float(spec["value"])
        self.mode = METRICS[self.metric]
        self.samples_per_step, self.tokens_per_sample = samples_per_step, tokens_per_sample
        self.world_size, self.device_hour_cost = world_size, device_hour_cost
        self.log, self.clock = log, clock
        self.before_s = self.before_device_s = 0.0  # earlier sessions' (from the checkpoint)
        self.t0: float | None = None
        self.reached: dict | None = None

    def on_train_begin(self, step: int) -> None:
        self.t0 = self.clock()

    def _spent(self) -> tuple[float, float]:
        """(wall seconds, device seconds) of training so far, every session included."""
        now = 0.0 if self.t0 is None else self.clock() - self.t0
        return self.before_s + now, self.before_device_s + now * self.world_size

    def _met(self, v: float) -> bool:
        return v <= self.value if self.mode == "min" else v >= self.value

    def _check(self, step: int, metrics: dict) -> dict | None:
        v = metrics.get(self.metric)
        if self.reached is not None or v is None or not self._met(v):
            return None
        wall, device = self._spent()
        rec = {"metric": self.metric, "target": self.value, "reached": True, "value": float(v), "step": step,
               "samples": step * self.samples_per_step, "wall_time_s": wall, "device_hours": device / 3600}
        if self.tokens_per_sample:
            rec["tokens"] = rec["samples"] * self.tokens_per_sample
        if self.device_hour_cost:
            rec["cost"] = rec["device_hours"] * self.device_hour_cost
        self.reached = rec
        seen = f"{rec['tokens']:,} tokens" if "tokens" in rec else f"{rec['samples']:,} samples"
        cost = f", cost {rec['cost']:.4g}" if "cost" in rec else ""
        self.log(f"target reached: {self.metric} {v:.4g} {'<=' if self.mode == 'min' else '>='} {self.value:g} at step "
                 f"{step} ({seen}, {wall:.1f} s, {rec['device_hours']:.3g} device-hours{cost})")
        return rec

    def on_eval(self, step: int, metrics: dict) -> Decision | None:
        rec = self._check(step, metrics)
        return Decision(events=({"step": step, "event": "target_reached", **rec},)) if rec else None

    def summary(self, step: int, final: dict) -> dict:
        self._check(step, final)  # the final evaluation may be the first to reach it
        return {"time_to_target": self.reached or {"metric": self.metric, "target": self.value, "reached": False,
                                                   "steps": step}}

    def state_dict(self) -> dict:
        wall, device = self._spent()
        return {"wall_s": wall, "device_s": device, "reached": self.reached}

    def load_state_dict(self, state: dict) -> None:
        self.before_s, self.before_device_s = float(state["wall_s"]), float(state["device_s"])
        self.reached = state.get("reached")
