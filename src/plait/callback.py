"""The callback contract of the training loop (plait.train.loop): hooks, decisions as data, state in checkpoints.

Torch-free and at the bottom of the layers, so that any component can bring a callback: the
training features (plait.train.callbacks), a scheme's (plait.parallel.hetero), fault injection
(plait.faults). The hooks are listed in plait.train.callbacks' docstring; each is optional.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    """What an evaluation decided: checkpoint this step, point checkpoints/best at it, stop the run."""

    save: bool = False
    mark_best: bool = False
    stop: bool = False
    events: tuple = ()  # records for metrics.jsonl (each with its "step")

    def __or__(self, other: Decision) -> Decision:
        return Decision(self.save or other.save, self.mark_best or other.mark_best, self.stop or other.stop,
                        self.events + other.events)


class Callback:
    """A loop feature; every hook is optional (the defaults do nothing)."""

    name = ""  # the key of its state in the checkpoint ("" : no state)
    # (step, rank) -> this rank's [begin, end) of a step's global batch, where a callback splits it (hetero)
    batch_slices: Callable[[int, int], tuple[int, int]] | None = None

    def on_resume(self, step: int) -> None: ...
    def on_train_begin(self, step: int) -> list[dict] | None: ...
    def on_step_begin(self, step: int) -> list[dict] | None: ...
    def after_compute(self, step: int, seconds: float, samples: int) -> float | None: ...
    def on_step_end(self, step: int) -> list[dict] | None: ...
    def on_eval(self, step: int, metrics: dict) -> Decision | None: ...
    def fields(self) -> dict: return {}
    def summary(self, step: int, final: dict) -> dict: return {}
    def on_train_end(self, step: int, checkpointer) -> None: ...
    def state_dict(self) -> dict: return {}
    def load_state_dict(self, state: dict) -> None: ...


class Callbacks:
    """The loop's callbacks, called in order; events concatenated, decisions merged."""

    def __init__(self, callbacks: list):
        self.items = list(callbacks)

    def _events(self, hook: str, *args) -> list[dict]:
        return [e for c in self.items for e in (getattr(c, hook)(*args) or [])]

    def on_resume(self, step: int) -> None:
        for c in self.items:
            c.on_resume(step)

    def on_train_begin(self, step: int) -> list[dict]:
        return self._events("on_train_begin", step)

    def on_step_begin(self, step: int) -> list[dict]:
        return self._events("on_step_begin", step)

    def after_compute(self, step: int, seconds: float, samples: int) -> None:
        for c in self.items:  # a callback that adds compute time (a slow-device fault) returns it: the next ones see it
            seconds += c.after_compute(step, seconds, samples) or 0.0

    def on_step_end(self, step: int) -> list[dict]:
        return self._events("on_step_end", step)

    def on_eval(self, step: int, metrics: dict) -> Decision:
        decision = Decision()
        for c in self.items:
            decision = decision | (c.on_eval(step, metrics) or Decision())
        return decision

    def fields(self) -> dict:
        return {k: v for c in self.items for k, v in c.fields().items()}

    def summary(self, step: int, final: dict) -> dict:
        return {k: v for c in self.items for k, v in c.summary(step, final).items()}

    def on_train_end(self, step: int, checkpointer) -> None:
        for c in self.items:
            c.on_train_end(step, checkpointer)

    def state_dict(self) -> dict:
        return {c.name: c.state_dict() for c in self.items if c.name}

    def load_state_dict(self, states: dict) -> None:
        for c in self.items:
            if c.name and c.name in states:
                c.load_state_dict(states[c.name])
