"""A training job's config, checked whole: its sections, its model and every parallel scheme's keys.

    cfg = load_job("job.toml", ["parallel.pp=2"])   # ConfigError before any worker starts
    layout = check_job(cfg)                           # the same checks on a Config built in code

plait.config checks each section on its own; what needs a model or a scheme (can this model be
cut into pipeline stages, does ZeRO-1 combine with tensor parallel) is asked of the model
registry and of each scheme here, so the CLI, the launcher, the planner and train() agree.
"""

from __future__ import annotations

from pathlib import Path

from plait.config import Config, load_config, validate_config
from plait.models import check_config as check_model
from plait.parallel import check_config as check_layout
from plait.parallel.layout import Layout


def check_job(cfg: Config) -> Layout:
    """Validate cfg for training; returns its Layout."""
    validate_config(cfg)
    check_model(cfg.model, cfg.data.name)
    return check_layout(cfg)


def load_job(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """load_config + check_job: a config ready to train."""
    cfg = load_config(path, overrides)
    check_job(cfg)
    return cfg
