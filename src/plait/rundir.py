"""Run directories: naming a new one, refusing one that would overwrite something, and the checked config.

    out = timestamped("bench-memory")           # runs/bench-memory-20261201-201300 (-2, -3, ... when taken)
    run_dir = new_run_dir(out, "--out")         # ConfigError for a folder that holds a run or other files
    write_checked_config(run_dir, text, world)  # config.toml, and a record that the launcher checked it whole
    checked_config(run_dir, world)              # True when config.toml is what was checked, at this world size

The launcher checks a job once, whole (its model on the meta device, every scheme, the user's code), then
writes config.toml and `.config.checked` with the text's SHA-256 and the world size it was checked for.
A worker that reads the same text at the same world size skips the check (plait.train.build); an
edited config.toml, or an elastic job resized to another world, is checked again in every worker.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from plait.errors import ConfigError

TRUST_ENV = "PLAIT_TRUST_CHECKPOINT"  # "1": accept checkpoints without a manifest (what --trust-checkpoint sets)

CHECKED = ".config.checked"


def timestamped(prefix: str = "", root: str | Path = "runs") -> Path:
    """runs/<prefix->YYYYmmdd-HHMMSS, with -2, -3, ... appended while that name is taken."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(root) / (f"{prefix}-{stamp}" if prefix else stamp)
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def new_run_dir(out: str | Path | None, flag: str = "--out", prefix: str = "") -> Path:
    """The folder a new run writes to: `out` (new, empty, or a run's own folder without checkpoints), or a new
    timestamped one under runs/. ConfigError names the folder and what to do instead."""
    if out is None:
        return timestamped(prefix)
    run_dir = Path(out)
    if (run_dir / "checkpoints").exists():
        raise ConfigError(f"{flag} {run_dir} already holds a run; continue it with --resume {run_dir} or choose "
                          f"another {flag}")
    check_writable_run_dir(run_dir, flag)
    return run_dir


def check_writable_run_dir(run_dir: Path, flag: str = "--out") -> None:
    """A run writes config.toml, metrics.jsonl, ... into run_dir: it must be new, empty, or a run's own folder."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"{flag} {run_dir} is a file, not a folder; choose another {flag}")
    if run_dir.is_dir() and not (run_dir / "config.toml").is_file() and any(run_dir.iterdir()):
        raise ConfigError(f"{flag} {run_dir} is a folder that holds other files and is not a plait run; training would "
                          "overwrite them: choose a new or empty folder")


def is_federated_run(run_dir: str | Path) -> bool:
    """A directory `plait fed simulate` or `plait fed server` wrote (it has partition.json, no checkpoints)."""
    return (Path(run_dir) / "partition.json").is_file() and not (Path(run_dir) / "checkpoints").exists()


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def write_checked_config(run_dir: Path, text: str, world_size: int) -> None:
    """config.toml (atomically: nodes sharing the run dir rewrite it) and the record that it was checked whole."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, body in (("config.toml", text),
                       (CHECKED, json.dumps({"sha256": _digest(text), "world_size": world_size}))):
        tmp = run_dir / f".{name}.{os.getpid()}"
        tmp.write_text(body)
        os.replace(tmp, run_dir / name)


def checked_config(run_dir: Path, world_size: int) -> bool:
    """Whether run_dir/config.toml is the text the launcher checked, for a job of `world_size` processes."""
    try:
        record = json.loads((run_dir / CHECKED).read_text())
        text = (run_dir / "config.toml").read_text()
    except (OSError, ValueError):
        return False
    return record.get("sha256") == _digest(text) and record.get("world_size") == world_size
