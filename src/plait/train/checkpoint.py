"""Checkpoints with torch.distributed.checkpoint (DCP): published atomically, verified on load.

Layout: run_dir/checkpoints/step_NNNNNNN/ (DCP shards, .metadata, trainer_state.json and
manifest.json) and run_dir/checkpoints/latest, a symlink to the newest complete one.

Publishing: every rank writes into a hidden temporary folder; when all are done, rank 0 writes
the trainer state and a manifest (size and CRC-32 of every file), fsyncs, renames the folder
into place and swaps `latest` with an atomic rename. A crash at any point leaves `latest` on a
complete checkpoint. Loading verifies the manifest first and names the file that is missing,
truncated or corrupt; `find_resumable` then falls back to the newest checkpoint that verifies.
Tensors are read through DCP (no pickled objects in plait's checkpoints).

`checkpoint.async = true` uses DCP's async_save: the step waits only while the state is staged
to memory; the files are written in the background and published when done (before the next
checkpoint starts, and at the end of training).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
import zlib
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from plait import faults
from plait.errors import CheckpointError

STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"


def _single() -> bool:
    """No process group: DCP reads and writes as one process."""
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


def file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(folder: Path) -> None:
    """Size and CRC-32 of every file in the checkpoint folder (fsynced, so the manifest means they are on disk)."""
    files = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name != MANIFEST:
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            files[p.name] = {"bytes": p.stat().st_size, "crc32": file_crc(p)}
    _write_json(folder / MANIFEST, {"files": files})


def verify(folder: Path) -> dict:
    """Check a checkpoint against its manifest; returns its trainer state or raises CheckpointError naming the file."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        if (folder / ".metadata").is_file() and (folder / STATE_FILE).is_file() and not folder.name.startswith("."):
            # Published before manifests existed (plait 0.1 runs): usable, but nothing to check it against.
            return json.loads((folder / STATE_FILE).read_text())
        raise CheckpointError(f"checkpoint {folder} is incomplete: {MANIFEST} is missing")
    try:
        files = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{manifest} is corrupt ({e})") from None
    for name, want in files.items():
        p = folder / name
        if not p.is_file():
            raise CheckpointError(f"checkpoint {folder} is damaged: {name} is missing")
        size = p.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint {folder} is damaged: {name} has {size} bytes, the manifest says "
                                  f"{want['bytes']} (truncated?)")
        if file_crc(p) != want["crc32"]:
            raise CheckpointError(f"checkpoint {folder} is damaged: {name} does not match its checksum (corrupt)")
    try:
        return json.loads((folder / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{folder / STATE_FILE} cannot be read ({e})") from None


class Checkpointer:
    """Saves a strategy's state under run_dir/checkpoints, synchronously or in the background."""

    def __init__(self, run_dir: str | Path, rt, keep: int, use_async: bool = False):
        self.root = checkpoint_dir(run_dir)
        self.rt, self.keep, self.use_async = rt, keep, use_async
        self._pending = None  # (future, tmp folder, final folder, trainer state)
        # A background save runs collectives from its own thread: give it a process group of its own
        # so they never interleave with training's (every rank creates it, in the same order).
        self.group = dist.new_group(backend="gloo") if use_async and not _single() else None

    def save(self, strategy, step: int, trainer_state: dict) -> float:
        """Checkpoint `step`; returns the seconds training was stalled for it."""
        t0 = time.perf_counter()
        self.finish()  # one checkpoint in flight at a time
        final = self.root / step_name(step)
        tmp = self.root / f".tmp-{step_name(step)}"
        if self.rt.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        self.rt.barrier()
        state = {**trainer_state, "step": step}
        with _quiet():
            if self.use_async and not _single():
                fut = dcp.async_save(strategy.state_dict(), checkpoint_id=str(tmp), process_group=self.group)
                self._pending = (fut, tmp, final, state)
                return time.perf_counter() - t0
            dcp.save(strategy.state_dict(), checkpoint_id=str(tmp), no_dist=_single())
        self._publish(tmp, final, state)
        return time.perf_counter() - t0

    def finish(self) -> None:
        """Wait for a background save and publish it."""
        if self._pending is None:
            return
        fut, tmp, final, state = self._pending
        self._pending = None
        fut.result()
        self._publish(tmp, final, state)

    def _publish(self, tmp: Path, final: Path, state: dict) -> None:
        self.rt.barrier()  # every rank's files are written
        if self.rt.is_main:
            _write_json(tmp / STATE_FILE, state)
            write_manifest(tmp)
            faults.maybe_fire("publish", self.rt.rank, state["step"])
            if final.exists():  # re-saving a step (a resumed run that ends where it began)
                trash = self.root / f".trash-{final.name}"
                shutil.rmtree(trash, ignore_errors=True)
                os.replace(final, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(tmp, final)
            link = self.root / ".latest.tmp"
            if link.is_symlink() or link.exists():
                link.unlink()
            os.symlink(final.name, link)
            os.replace(link, self.root / "latest")
            _fsync_dir(self.root)
            prune(self.root, self.keep)
        self.rt.barrier()


def save_checkpoint(strategy, run_dir: str | Path, step: int, trainer_state: dict, rt, keep: int) -> Path:
    """Write and publish a checkpoint of `step` synchronously (see Checkpointer)."""
    Checkpointer(run_dir, rt, keep).save(strategy, step, trainer_state)
    return checkpoint_dir(run_dir) / step_name(step)


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


def find_resumable(run_dir: str | Path, log=print) -> Path | None:
    """The newest checkpoint that verifies: `latest` first, then older ones, saying why each was skipped."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return None
    candidates = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    link = root / "latest"
    if link.is_symlink() and link.resolve().is_dir():
        first = link.resolve()
        candidates = [first] + [c for c in candidates if c.resolve() != first]
    for c in candidates:
        try:
            verify(c)
            return c
        except CheckpointError as e:
            log(f"warning: {e}; falling back to an older checkpoint")
    if candidates:
        raise CheckpointError(f"no checkpoint under {root} verifies; delete the folder to start over")
    return None


def read_trainer_state(path: Path) -> dict:
    return verify(path)


def load_checkpoint(strategy, path: Path) -> dict:
    """Verify, then load model and optimizer state into the strategy (any layout); returns the trainer state."""
    state = verify(path)
    sd = strategy.state_dict()
    with _quiet():
        dcp.load(sd, checkpoint_id=str(path), no_dist=_single())
    strategy.load_state_dict(sd)
    return state


def load_model_weights(module, path: Path) -> None:
    """Load only the model's weights from a checkpoint into a plain module (no process group needed)."""
    verify(path)
    sd = {"model": module.state_dict()}
    with _quiet():
        dcp.load(sd, checkpoint_id=str(path), no_dist=_single())
    module.load_state_dict(sd["model"])
