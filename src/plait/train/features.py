"""The trainer's features, registered as the parallel schemes are: each one a line in FEATURES, in the order the
loop's callbacks run (the schedule, then what changes the step, then what decides), with when it is on and the
callback it adds. Adding a feature adds its module and one line here; train/build.py does not grow.

A feature's `make(cfg, b, strategy, bundle, loss_fn)` returns its callback (or a list of them, or None). The
parallel schemes' own callbacks (plait.parallel: `Build.callbacks`) run where the SCHEMES entry stands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from plait.callback import Callback
from plait.config import Config
from plait.data.stream import StreamSampler
from plait.faults import SlowDevice
from plait.finetune import ProgressiveFreeze
from plait.parallel import Build, Strategy
from plait.train.callbacks import DropoutSeed, EarlyStopping, KeepBest, LearningRate, PatchSteps
from plait.train.continual import Continual
from plait.train.loss import loss_for
from plait.train.progressive import Freezer
from plait.train.target import TimeToTarget


@dataclass(frozen=True)
class Feature:
    name: str
    on: Callable[[Config], bool]
    make: Callable[..., Callback | list[Callback] | None]  # (cfg, b, strategy, bundle, loss_fn)


def _continual(cfg: Config, b: Build, strategy: Strategy, bundle, loss_fn) -> Callback:
    t = cfg.train
    sampler = StreamSampler([len(tr) for tr, _ in bundle.tasks], t.global_batch_size, t.seed, t.steps)
    return Continual(strategy, cfg, b.rt, bundle, sampler.boundaries(), loss_for(bundle.spec), b.run_dir)


def _target(cfg: Config, b: Build, strategy: Strategy, bundle, loss_fn) -> Callback:
    t, spec = cfg.train, bundle.spec
    per_sample = spec.tokens_per_sample if spec.task == "lm" else None
    return TimeToTarget(t.target, t.global_batch_size, per_sample, b.rt.world_size, cfg.launch.device_hour_cost,
                        log=b.rt.print)


FEATURES: list[Feature] = [
    Feature("learning rate", lambda c: True,
            lambda c, b, s, d, f: LearningRate(s, c.optim, c.train.steps, c.train.global_batch_size)),
    Feature("dropout seed", lambda c: c.model.dropout > 0, lambda c, b, s, d, f: DropoutSeed(c.train.seed, b.rt.rank)),
    Feature("patch steps", lambda c: bool(c.model.patch_size), lambda c, b, s, d, f: PatchSteps(s.module, c.train.seed)),
    Feature("progressive freeze", lambda c: bool(c.finetune.progressive_freeze),
            lambda c, b, s, d, f: Freezer(ProgressiveFreeze(s.module, c.train.steps, c.finetune.progressive_freeze_start,
                                                            whole=b.module), s)),
    Feature("slow device", lambda c: True, lambda c, b, s, d, f: SlowDevice(b.rt.rank)),  # before hetero measures
    Feature("schemes", lambda c: True, lambda c, b, s, d, f: b.callbacks(s)),
    Feature("continual", lambda c: bool(c.data.stream), _continual),  # the forgetting table, EWC
    Feature("loss figures", lambda c: True, lambda c, b, s, d, f: f if isinstance(f, Callback) else None),
    Feature("keep best", lambda c: bool(c.checkpoint.keep_best), lambda c, b, s, d, f: KeepBest(c.checkpoint.keep_best)),
    Feature("early stop", lambda c: bool(c.train.early_stop),
            lambda c, b, s, d, f: EarlyStopping(c.train.early_stop, log=b.rt.print)),
    Feature("time to target", lambda c: bool(c.train.target), _target),
]


def callbacks_for(cfg: Config, b: Build, strategy: Strategy, bundle, loss_fn=None) -> list[Callback]:
    """The loop's callbacks: each enabled feature's, in FEATURES' order."""
    found: list[Callback] = []
    for feature in FEATURES:
        if feature.on(cfg):
            made = feature.make(cfg, b, strategy, bundle, loss_fn)
            found += made if isinstance(made, list) else [made] if made is not None else []
    return found
