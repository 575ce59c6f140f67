"""One model replica (dp = 1): the base Strategy owns the step, on plain or tensor-parallel modules."""

from __future__ import annotations

from plait.parallel.base import Strategy
from plait.parallel.scheme import Build


def build(b: Build) -> Strategy:
    strategy = Strategy(b.parallelize(b.module), b.module, b.make_optimizer(b.module), b.loss_fn, b.precision,
                        b.local_batch)
    strategy.tensor_parallel = strategy.sharded = b.rt.axis_size("tp") > 1
    return strategy
