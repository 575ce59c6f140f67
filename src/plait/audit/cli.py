"""`plait data pack` and `plait data audit`.

    plait data pack SOURCE -o DIR [--shard-size 64MB] [--set data.*=...]
    plait data audit [CONFIG] [--set data.*=...] --out DIR [--folds 5] [--epochs 10] [--keep 0.5]

SOURCE is a source name (digits, synthetic, clicks, stdlib-text), a folder with one sub-folder of
images per class, a folder of text files or a text file, or a .npy / .npz / .pt tensors file.
"""

from __future__ import annotations

from pathlib import Path

from plait.config import load_config
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
        from plait.data.images import SUFFIXES  # lazily: plait --help must not import torch

        has_images = any(f.suffix.lower() in SUFFIXES for d in p.iterdir() if d.is_dir() for f in d.rglob("*"))
        return [f"data.name='{'images' if has_images else 'text'}'", f"data.path='{p}'"]
    if p.suffix in (".npy", ".npz", ".pt"):
        return ["data.name='tensors'", f"data.path='{p}'"]
    return ["data.name='text'", f"data.path='{p}'"]


def cmd_pack(a) -> int:
    # lazily: plait --help must not import torch
    from plait.data import build_data  # lazily: plait --help must not import torch
    from plait.data.packed import pack, parse_size  # lazily: plait --help must not import torch

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
    from plait.audit.audit import run_audit  # lazily: plait --help must not import torch or cleanlab

    cfg = load_config(a.config, a.set)
    report = run_audit(cfg, Path(a.out), folds=a.folds, epochs=a.epochs, keep=a.keep)
    print("\n".join(report["summary"]))
    return 0


def add_parsers(sub, bench) -> None:
    d = sub.add_parser("data", help="pack a dataset into shards; audit a dataset's labels, duplicates and outliers")
    dsub = d.add_subparsers(dest="data_verb", required=True, metavar="ACTION")
    p = dsub.add_parser("pack", help="write a source as compressed LitData shards for data.name = 'packed'")
    p.add_argument("source", help="digits | synthetic | clicks | stdlib-text | an image folder | a text file or folder | "
                                  "a .npy/.npz/.pt file")
    p.add_argument("-o", "--output", type=Path, required=True, help="new folder for the shards and their index")
    p.add_argument("--shard-size", default="64MB", help="bytes per shard before compression, e.g. 64MB (default)")
    p.add_argument("--config", help="TOML config whose [data]/[model] sections apply (e.g. model.context for text)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    p.set_defaults(fn=cmd_pack)
    au = dsub.add_parser("audit", help="label issues (cleanlab), duplicates, outliers, class balance -> audit.json")
    au.add_argument("config", nargs="?", help="TOML config (its [data] and [model] sections are audited)")
    au.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    au.add_argument("--out", required=True, help="folder for audit.json and report.html")
    au.add_argument("--folds", type=int, default=5, help="cross-validation folds for the out-of-fold probabilities")
    au.add_argument("--epochs", type=float, default=10.0, help="passes over each fold's training part")
    au.add_argument("--keep", type=float, default=0.5, help="volume reduction: fraction of the data the coreset keeps")
    au.set_defaults(fn=cmd_audit)
