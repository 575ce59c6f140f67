"""Checkpoints with torch.distributed.checkpoint (DCP), published atomically.

Layout: run_dir/checkpoints/step_NNNNNNN/ (DCP shards + .metadata + trainer_state.json)
and run_dir/checkpoints/latest, a symlink to the newest complete one. A checkpoint is
written into a hidden temporary folder and renamed into place only when complete, and
`latest` is swapped with an atomic rename, so a crash mid-write never leaves `latest`
pointing at a partial checkpoint. Loading reads tensors through DCP (no pickle code).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from plait.errors import CheckpointError

STATE_FILE = "trainer_state.json"


def _single() -> bool:
    """No process group: DCP reads and writes as one process (and says nothing about it)."""
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet():
    """DCP warns that it runs as one process even when asked to (no_dist=True)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step_{step:07d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(strategy, run_dir: str | Path, step: int, trainer_state: dict, rt, keep: int) -> Path:
    """Write a checkpoint of everything needed to resume after `step` steps, then publish it."""
    root = checkpoint_dir(run_dir)
    final = root / step_name(step)
    tmp = root / f".tmp-{step_name(step)}"
    if rt.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    rt.barrier()
    with _quiet():
        dcp.save(strategy.state_dict(), checkpoint_id=str(tmp), no_dist=_single())
    if rt.is_main:
        _write_json(tmp / STATE_FILE, {**trainer_state, "step": step})
        if final.exists():  # re-saving a step (e.g. a resumed run that ends where it began)
            trash = root / f".trash-{step_name(step)}"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, final)
        link = root / ".latest.tmp"
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(final.name, link)
        os.replace(link, root / "latest")
        _fsync_dir(root)
        prune(root, keep)
    rt.barrier()
    return final


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` published checkpoints (never the one `latest` names)."""
    current = os.readlink(root / "latest") if (root / "latest").is_symlink() else None
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for p in steps[:-keep] if keep > 0 else []:
        if p.name != current:
            shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint `latest` points to, or None if the run has none."""
    link = checkpoint_dir(run_dir) / "latest"
    if not link.is_symlink() and not link.exists():
        return None
    target = link.resolve()
    if not target.is_dir():
        raise CheckpointError(f"{link} points to {target}, which does not exist; the run directory is damaged")
    return target


def read_trainer_state(path: Path) -> dict:
    for name in (".metadata", STATE_FILE):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    try:
        return json.loads((path / STATE_FILE).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / STATE_FILE} is not valid JSON ({e})") from None


def load_checkpoint(strategy, path: Path) -> dict:
    """Load model and optimizer state into the strategy (any layout); returns the trainer state."""
    state = read_trainer_state(path)
    sd = strategy.state_dict()
    with _quiet():
        dcp.load(sd, checkpoint_id=str(path), no_dist=_single())
    strategy.load_state_dict(sd)
    return state


def load_model_weights(module, path: Path) -> None:
    """Load only the model's weights from a checkpoint into a plain module (no process group needed)."""
    read_trainer_state(path)
    sd = {"model": module.state_dict()}
    with _quiet():
        dcp.load(sd, checkpoint_id=str(path), no_dist=_single())
    module.load_state_dict(sd["model"])
