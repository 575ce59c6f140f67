"""Training: one code path for 1 and N processes, every layout, every role.

    result = train(cfg, run_dir)               # in each worker (or in a single process)
    result = train(cfg, run_dir, resume=True)  # continue from run_dir/checkpoints/latest

train() builds the job (plait.train.build) and runs the loop (plait.train.loop); a rank whose role is
to serve the others (a parameter server) serves instead and returns its summary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn

from plait.config import Config
from plait.parallel import Strategy
from plait.runtime import Runtime
from plait.train.build import Served, build_job
from plait.train.loop import run


@dataclass
class TrainResult:
    summary: dict
    module: nn.Module | None  # the plain model, single-process parameter names (None on a parameter server)
    strategy: Strategy | None
    runtime: Runtime


def train(cfg: Config, run_dir: str | Path | None = None, resume: bool = False, checked: bool = False) -> TrainResult:
    """Run (or continue) training as configured; every rank calls this. checked: the launcher checked cfg whole."""
    job = build_job(cfg, run_dir, resume, checked)
    if isinstance(job, Served):
        return TrainResult(job.summary, None, None, job.runtime)
    summary = run(job)
    return TrainResult(summary, job.strategy.module, job.strategy, job.rt)
