"""Continuing a run: which overrides a resume may take, forking a run into a new directory, absolute paths.

    check_resume_overrides(saved, cfg, run_dir)  # ConfigError for an override that changes the model's shapes
    fork_run(src, dst)                           # dst: a new run holding src's config and latest checkpoint
    absolute_paths(cfg)                          # data.path and friends resolved, so a resume works from anywhere
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from plait.config import Config
from plait.errors import ConfigError

# model.* keys that leave every parameter's shape as it was: a resume may change them
RESUMABLE_MODEL_KEYS = {"dropout", "moe_capacity_factor", "moe_aux_weight"}
# path-valued keys, stored absolute in a run's config.toml
PATH_KEYS = (("data", "path"), ("data", "exclude"), ("data", "tokenizer"), ("train", "init_from"), ("distill", "teacher"))


def check_resume_overrides(saved: Config, cfg: Config, run_dir: Path) -> None:
    """A resumed run loads its checkpoint into the model: an override that changes the model's shapes (or the data,
    which fixes the vocabulary) would load the wrong tensors, so it is refused naming the key and both values."""
    changed = [(f"model.{f.name}", getattr(saved.model, f.name), getattr(cfg.model, f.name))
               for f in dataclasses.fields(saved.model) if f.name not in RESUMABLE_MODEL_KEYS]
    changed.append(("data.name", saved.data.name, cfg.data.name))
    for key, old, new in changed:
        if old != new:
            raise ConfigError(
                f"--resume {run_dir} --set {key}={new!r}: the run was saved with {key} = {old!r} and its checkpoint "
                f"holds that model; drop the override, or start a new run from its weights with "
                f"--set train.init_from={str(run_dir)!r} --out NEW_DIR"
            )


def fork_run(src: Path, dst: Path) -> Path:
    """`--resume SRC --out DST`: DST becomes a new run with SRC's config.toml, its latest checkpoint and its metrics;
    training then continues in DST and SRC is left as it was."""
    from plait.train.checkpoint import latest_checkpoint  # lazily: plait train imports this before torch

    ckpt = latest_checkpoint(src)
    if ckpt is None:
        raise ConfigError(f"--resume {src} --out {dst}: {src} has no checkpoint yet, so there is nothing to fork; "
                          f"start a new run with plait train {src / 'config.toml'} --out {dst}")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConfigError(f"--resume {src} --out {dst}: forking needs a new or empty --out folder")
    (dst / "checkpoints").mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / "config.toml", dst / "config.toml")
    if (src / "metrics.jsonl").is_file():
        shutil.copy2(src / "metrics.jsonl", dst / "metrics.jsonl")  # the resumed run cuts it at the checkpoint's step
    shutil.copytree(ckpt, dst / "checkpoints" / ckpt.name)
    os.symlink(ckpt.name, dst / "checkpoints" / "latest")
    print(f"forked {src} at {ckpt.name} into {dst}", flush=True)
    return dst


def absolute_paths(cfg: Config) -> None:
    """Resolve relative local paths against the current directory (URLs stay as they are)."""
    for section, key in PATH_KEYS:
        sec = getattr(cfg, section, None)
        value = getattr(sec, key, "") if sec is not None else ""
        if value and "://" not in value:
            setattr(sec, key, str(Path(value).expanduser().resolve()))
