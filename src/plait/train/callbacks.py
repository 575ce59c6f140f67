"""Decisions taken at evaluations: early stopping and keeping the best checkpoint.

    best = Best("val_loss", min_delta=0.0)       # val_loss: lower is better; val_accuracy: higher
    best.update(step, {"val_loss": 2.1})         # True when the metric improved by more than min_delta
    stop = EarlyStop.from_config(cfg.train.early_stop)   # None when off
    stop.update(step, metrics)                   # True once `patience` evaluations in a row did not improve

Every rank sees the same evaluation (its metrics are reduced over the ranks), so every rank decides the same.
"""

from __future__ import annotations

from plait.errors import ConfigError

METRICS = {"val_loss": "min", "val_accuracy": "max"}
EARLY_STOP_KEYS = {"metric", "patience", "min_delta"}


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


def check(cfg) -> None:
    """train.early_stop and checkpoint.keep_best, checked as data before any worker starts."""
    spec = cfg.train.early_stop
    if spec:
        unknown = sorted(set(spec) - EARLY_STOP_KEYS)
        if unknown:
            raise ConfigError(f"train.early_stop has unknown keys {unknown}; it takes metric, patience and min_delta, "
                              "e.g. {metric = 'val_loss', patience = 3, min_delta = 0.0}")
        if spec.get("metric", "val_loss") not in METRICS:
            raise ConfigError(f"train.early_stop.metric = {spec['metric']!r}: choose one of {sorted(METRICS)}")
        p = spec.get("patience", 3)
        if not isinstance(p, int) or isinstance(p, bool) or p < 1:
            raise ConfigError(f"train.early_stop.patience = {p!r} must be an integer >= 1 (evaluations without improvement)")
        d = spec.get("min_delta", 0.0)
        if not isinstance(d, (int, float)) or isinstance(d, bool) or d < 0:
            raise ConfigError(f"train.early_stop.min_delta = {d!r} must be a number >= 0")
    keep_best = cfg.checkpoint.keep_best
    if keep_best and keep_best not in METRICS:
        raise ConfigError(f"checkpoint.keep_best = {keep_best!r}: choose one of {sorted(METRICS)} (or '' for off)")
    if (spec or keep_best) and cfg.parallel.sync == "ps":
        raise ConfigError("train.early_stop and checkpoint.keep_best need every rank to evaluate; the parameter "
                          "server's workers do not (parallel.sync = 'ps'): use allreduce or gossip")
    if (spec or keep_best) and not cfg.train.eval_every:
        what = "train.early_stop" if spec else "checkpoint.keep_best"
        raise ConfigError(f"{what} decides at evaluations: set train.eval_every (e.g. --set train.eval_every=50)")
