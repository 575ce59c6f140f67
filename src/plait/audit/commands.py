"""What `plait data pack` and `plait data audit` do (their parsers: plait.audit.cli). Imported when one of them runs;
cleanlab, which the audit needs, is imported by the audit as it starts.
"""

from __future__ import annotations

from pathlib import Path

from plait.audit.audit import run_audit
from plait.config import load_config
from plait.data import build_data
from plait.data.images import SUFFIXES
from plait.data.packed import pack, parse_size
from plait.errors import ConfigError

NAMED = ("digits", "synthetic", "clicks", "stdlib-text")


def source_overrides(source: str) -> list[str]:
    """The data.* settings that read SOURCE."""
    if source in NAMED:
        return [f"data.name='{source}'"]
    p = Path(source)
    if not p.exists():
        raise ConfigError(f"SOURCE {source!r} is neither a source name ({', '.join(NAMED)}) nor an existing file or folder")
    if p.is_dir():
        has_images = any(f.suffix.lower() in SUFFIXES for d in p.iterdir() if d.is_dir() for f in d.rglob("*"))
        return [f"data.name='{'images' if has_images else 'text'}'", f"data.path='{p}'"]
    if p.suffix in (".npy", ".npz", ".pt"):
        return ["data.name='tensors'", f"data.path='{p}'"]
    return ["data.name='text'", f"data.path='{p}'"]


def cmd_pack(a) -> int:
    cfg = load_config(a.config, [*source_overrides(a.source), *a.set])
    if cfg.data.exclude:
        raise ConfigError("data.exclude applies when training; pack the whole source and exclude at training time")
    bundle = build_data(cfg.data, cfg.model)
    meta = pack(bundle, a.output, parse_size(a.shard_size), source={"name": cfg.data.name, "path": cfg.data.path})
    sizes = meta["sizes"]
    shards = sum(1 for _ in Path(a.output).glob("*/chunk-*.bin"))
    print(f"packed {cfg.data.name} ({sizes['train']} train + {sizes['val']} validation samples) into {shards} shard(s) "
          f"under {a.output}; train on it with --set data.name=packed --set data.path={a.output}")
    return 0


def cmd_audit(a) -> int:
    cfg = load_config(a.config, a.set)
    report = run_audit(cfg, Path(a.out), folds=a.folds, epochs=a.epochs, keep=a.keep)
    print("\n".join(report["summary"]))
    return 0
