"""Checkpoints with torch.distributed.checkpoint (DCP): published atomically, verified on load.

Layout: run_dir/checkpoints/step_NNNNNNN/ (DCP shards, .metadata, trainer_state.json and
manifest.json) and run_dir/checkpoints/latest, a symlink to the newest complete one.

Publishing: every rank writes into a hidden temporary folder; when all are done, rank 0 writes
the trainer state and a manifest (size and CRC-32 of every file), fsyncs, renames the folder
into place and swaps `latest` with an atomic rename. A crash at any point leaves `latest` on a
complete checkpoint. Loading verifies the manifest first and names the file that is missing,
truncated or corrupt; `find_resumable` then falls back to the newest checkpoint that verifies.

What is unpickled, and how (docs/security.md): DCP's own `.metadata` file is a pickle, and DCP
stores non-tensor state (optimizer hyper-parameters, the loss scale) with `torch.save`. plait
never hands either to plain `pickle`: `.metadata` goes through `read_metadata`, an unpickler
that builds only the metadata classes torch writes (anything else is refused with a
CheckpointError naming the file), and non-tensor entries and tensors are read with
`torch.load(weights_only=True)`. Files a checkpoint's metadata points to must be plain names
inside the checkpoint folder and listed in its manifest. A checkpoint without a manifest is
refused unless trusted (`--trust-checkpoint`, or PLAIT_TRUST_CHECKPOINT=1 in the environment,
which is how the flag reaches training workers); `checkpoints/latest` must point inside
`checkpoints/`. The manifest's CRC-32s catch damage, not forgery: they are no signature.

`checkpoint.async = true` uses DCP's async_save: the step waits only while the state is staged
to memory; the files are written in the background and published when done (before the next
checkpoint starts, and at the end of training).

DCP itself is imported where a checkpoint is written or read, not with this module: finding, verifying and
pruning checkpoints (what the launcher and `plait export --help` need) cost no second of import.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import pathlib
import pickle
import re
import shutil
import time
import warnings
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from plait import faults
from plait.errors import CheckpointError
from plait.rundir import TRUST_ENV

if TYPE_CHECKING:
    from torch.distributed.checkpoint import metadata as dcp_metadata

STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
METADATA = ".metadata"
STEP_RE = re.compile(r"^step_\d{7}$")
PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$|^\.metadata$")


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


def trusted(trust: bool | None = None) -> bool:
    """Whether checkpoints without a manifest are accepted: `trust`, or else $PLAIT_TRUST_CHECKPOINT = 1."""
    return bool(trust) if trust is not None else os.environ.get(TRUST_ENV) == "1"


def _read_manifest(folder: Path) -> dict[str, dict]:
    manifest = folder / MANIFEST
    try:
        files = json.loads(manifest.read_text())["files"]
        if not isinstance(files, dict):
            raise ValueError("'files' is not an object")
        for name, want in files.items():
            if not PLAIN_NAME.match(name) or name in (".", ".."):
                raise ValueError(f"{name!r} is not a file name inside the checkpoint")
            if not (isinstance(want, dict) and all(isinstance(want.get(k), int) and not isinstance(want.get(k), bool)
                                                   for k in ("bytes", "crc32"))):
                raise ValueError(f"the entry of {name!r} needs integer 'bytes' and 'crc32'")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointError(f"{manifest} is corrupt ({e})") from None
    return files


def verify(folder: Path, trust: bool | None = None, deep: bool = True) -> dict:
    """Check a checkpoint against its manifest; returns its trainer state or raises CheckpointError naming the file.

    A checkpoint without a manifest (plait 0.1 wrote none) is refused unless `trust` (or $PLAIT_TRUST_CHECKPOINT=1).
    deep=False checks names and sizes only, not checksums (what a launcher can afford before the workers check all).
    """
    manifest = folder / MANIFEST
    if not manifest.is_file():
        legacy = (folder / METADATA).is_file() and (folder / STATE_FILE).is_file() and not folder.name.startswith(".")
        if not legacy:
            raise CheckpointError(f"checkpoint {folder} is incomplete: {MANIFEST} is missing")
        if not trusted(trust):
            raise CheckpointError(f"checkpoint {folder} has no {MANIFEST}, so nothing shows it is a complete checkpoint "
                                  "written by plait; if you wrote it yourself (plait 0.1), pass --trust-checkpoint")
        return _read_state(folder)
    files = _read_manifest(folder)
    for required in (METADATA, STATE_FILE):
        if required not in files:
            raise CheckpointError(f"{manifest} does not cover {required}; the checkpoint cannot be checked")
    for name, want in files.items():
        p = folder / name
        if p.is_symlink():
            raise CheckpointError(f"checkpoint {folder} is damaged: {name} is a symbolic link (plait writes plain files)")
        if not p.is_file():
            raise CheckpointError(f"checkpoint {folder} is damaged: {name} is missing")
        size = p.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint {folder} is damaged: {name} has {size} bytes, the manifest says "
                                  f"{want['bytes']} (truncated?)")
        if deep and file_crc(p) != want["crc32"]:
            raise CheckpointError(f"checkpoint {folder} is damaged: {name} does not match its checksum (corrupt)")
    return _read_state(folder)


def _read_state(folder: Path) -> dict:
    try:
        state = json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{folder / STATE_FILE} cannot be read ({e})") from None
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{folder / STATE_FILE} is corrupt: it needs a non-negative integer 'step'")
    return state


# ---------------------------------------------------------------------------- reading DCP safely

def _metadata_classes() -> dict[tuple[str, str], object]:
    """What a DCP .metadata pickle may name: torch's metadata dataclasses and enums, sizes, dtypes, layouts, paths."""
    from torch.distributed.checkpoint import metadata as dcp_metadata

    allowed: dict[tuple[str, str], object] = {}
    for name, value in vars(dcp_metadata).items():
        if isinstance(value, type) and value.__module__ == dcp_metadata.__name__:
            allowed[(dcp_metadata.__name__, name)] = value
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, where: Path):
        super().__init__(f)
        self.where = where
        self.allowed = _metadata_classes()

    def find_class(self, module: str, name: str):
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise CheckpointError(f"{self.where} names {module}.{name}, which is not part of a checkpoint's metadata; "
                                  "refusing to load it (a DCP .metadata file holds only torch's metadata classes)") from None

    def persistent_load(self, pid):
        raise CheckpointError(f"{self.where} holds a persistent reference; refusing to load it")


def read_metadata(folder: Path) -> dcp_metadata.Metadata:
    """DCP's .metadata of a checkpoint, unpickled with only torch's metadata classes allowed; checked for plain file names."""
    from torch.distributed.checkpoint import metadata as dcp_metadata

    path = Path(folder) / METADATA
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror})") from None
    except Exception as e:  # anything a crafted pickle can raise while being built from allowed classes
        raise CheckpointError(f"{path} is not a checkpoint's metadata ({type(e).__name__}: {e})") from None
    if not isinstance(md, dcp_metadata.Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise CheckpointError(f"{path} is not a checkpoint's metadata (it holds a {type(md).__name__})")
    listed = None
    if (Path(folder) / MANIFEST).is_file():
        listed = set(_read_manifest(Path(folder)))
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not PLAIN_NAME.match(rel) or rel == METADATA:
            raise CheckpointError(f"{path} points to {rel!r}, which is not a data file inside the checkpoint")
        if listed is not None and rel not in listed:
            raise CheckpointError(f"{path} points to {rel}, which the checkpoint's {MANIFEST} does not list")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{path} asks for stream transforms {info.transform_descriptors!r}; plait writes none")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
            raise CheckpointError(f"{path} has a data entry with a bad offset or length")
    return md


@functools.cache
def _safe_reader_and_planner() -> tuple[type, type]:
    """DCP's file reader and default load planner, made safe (classes built on first use: DCP is imported lazily)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _SafeReader(FileSystemReader):
        """DCP's file reader, handing DCP the metadata `read_metadata` has read and checked (no plain pickle.load)."""

        def __init__(self, path: Path, md: dcp_metadata.Metadata):
            super().__init__(str(path))
            self._md = md

        def read_metadata(self, *args, **kwargs):
            md = self._md
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = dcp_metadata.StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md


    class _SafePlanner(DefaultLoadPlanner):
        """DCP's default load planner, except that non-tensor entries are read with torch.load(weights_only=True)."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._traverse import set_element

            try:
                obj = torch.load(value, weights_only=True)
            except Exception as e:
                raise CheckpointError(f"entry {read_item.dest_index.fqn} is not plain data ({type(e).__name__}); "
                                      "refusing to unpickle it") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return _SafeReader, _SafePlanner


def _dcp_load(state_dict: dict, path: Path) -> None:
    """dcp.load through the safe reader and planner; DCP's failures become one CheckpointError naming the checkpoint."""
    import torch.distributed.checkpoint as dcp  # lazily, as everywhere here: a second of import the launcher never needs
    from torch.distributed.checkpoint.api import CheckpointException

    reader_cls, planner_cls = _safe_reader_and_planner()
    reader = reader_cls(path, read_metadata(path))  # checked here, so that a refusal is one clean error on every rank
    try:
        with _quiet():
            dcp.load(state_dict, storage_reader=reader, planner=planner_cls(), no_dist=_single())
    except CheckpointException as e:
        errors = [exc for exc, _ in e.failures.values()] if isinstance(e.failures, dict) else []
        mine = next((x for x in errors if isinstance(x, CheckpointError)), None)
        if mine is not None:
            raise CheckpointError(str(mine)) from None
        first = errors[0] if errors else e
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {type(first).__name__}: "
                              f"{str(first).strip().splitlines()[0] if str(first).strip() else ''}") from None


class Checkpointer:
    """Saves a strategy's state under run_dir/checkpoints, synchronously or in the background."""

    def __init__(self, run_dir: str | Path, rt, keep: int, use_async: bool = False):
        self.root = checkpoint_dir(run_dir)
        self.rt, self.keep, self.use_async = rt, keep, use_async
        self._pending: tuple | None = None  # (future, tmp folder, final folder, trainer state)
        # A background save runs collectives from its own thread: give it a process group of its own
        # so they never interleave with training's (every rank creates it, in the same order).
        self.group = dist.new_group(backend="gloo") if use_async and not _single() else None

    def save(self, strategy, step: int, trainer_state: dict) -> float:
        """Checkpoint `step`; returns the seconds training was stalled for it."""
        import torch.distributed.checkpoint as dcp

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


    def mark_best(self, step: int) -> None:
        """Point checkpoints/best at step's checkpoint (published), which pruning then keeps."""
        self.finish()
        if self.rt.is_main:
            link = self.root / ".best.tmp"
            if link.is_symlink() or link.exists():
                link.unlink()
            os.symlink(step_name(step), link)
            os.replace(link, self.root / "best")
            prune(self.root, self.keep)


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` published checkpoints (never the ones `latest` and `best` name)."""
    named = {os.readlink(root / n) for n in ("latest", "best") if (root / n).is_symlink()}
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for p in steps[:-keep] if keep > 0 else []:
        if p.name not in named:
            shutil.rmtree(p, ignore_errors=True)


def _inside(root: Path, target: Path) -> bool:
    """Whether `target` (resolved) is a step folder directly inside `root` (resolved)."""
    return target.parent == root.resolve() and bool(STEP_RE.match(target.name))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint `latest` points to, or None if the run has none (it must point inside checkpoints/)."""
    root = checkpoint_dir(run_dir)
    link = root / "latest"
    if not link.is_symlink() and not link.exists():
        return None
    target = link.resolve()
    if not _inside(root, target):
        raise CheckpointError(f"{link} points to {target}, outside {root}; plait follows it only to a step_NNNNNNN "
                              "folder of the same run (the run directory is damaged or was tampered with)")
    if not target.is_dir():
        raise CheckpointError(f"{link} points to {target}, which does not exist; the run directory is damaged")
    return target


def find_resumable(run_dir: str | Path, log=print, trust: bool | None = None, deep: bool = True) -> Path | None:
    """The newest checkpoint that verifies: `latest` first, then older ones, saying why each was skipped (deep=False:
    without checksums, see `verify`)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return None
    candidates = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    link = root / "latest"
    if link.is_symlink() and link.resolve().is_dir():
        first = link.resolve()
        candidates = [first] + [c for c in candidates if c.resolve() != first]
    elif link.is_symlink():
        log(f"warning: {link} points to {os.readlink(link)}, which is not there; falling back to the newest checkpoint "
            "that verifies")
    for c in candidates:
        try:
            if not _inside(root, c.resolve()):
                raise CheckpointError(f"{c} leads outside {root} ({c.resolve()})")
            verify(c, trust, deep)
            return c
        except CheckpointError as e:
            log(f"warning: {e}; falling back to an older checkpoint")
    if candidates:
        raise CheckpointError(f"no checkpoint under {root} verifies; delete the folder to start over")
    return None


def read_trainer_state(path: Path, trust: bool | None = None) -> dict:
    return verify(path, trust)


def load_checkpoint(strategy, path: Path, trust: bool | None = None) -> dict:
    """Verify, then load model and optimizer state into the strategy (any layout); returns the trainer state."""
    state = verify(path, trust)
    sd = strategy.state_dict()
    saved = read_metadata(path).state_dict_metadata
    for key in strategy.optional_state:  # entries a checkpoint of another layout may lack
        if not any(k == key or k.startswith(key + ".") for k in saved):
            sd.pop(key, None)
    _dcp_load(sd, path)
    strategy.load_state_dict(sd)
    return state


def load_model_weights(module, path: Path, trust: bool | None = None) -> None:
    """Load only the model's weights from a checkpoint into a plain module (no process group needed)."""
    verify(path, trust)
    sd = {"model": module.state_dict()}
    _dcp_load(sd, path)
    try:
        module.load_state_dict(sd["model"])
    except (RuntimeError, TypeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path} does not fit the run's model: {str(e).strip().splitlines()[0]}") from None
