"""`plait data pack` and `plait data audit`.

    plait data pack SOURCE -o DIR [--shard-size 64MB] [--set data.*=...]
    plait data audit [CONFIG] [--set data.*=...] --out DIR [--folds 5] [--epochs 10] [--keep 0.5]

SOURCE is a source name (digits, synthetic, clicks, stdlib-text), a folder with one sub-folder of
images per class, a folder of text files or a text file, or a .npy / .npz / .pt tensors file.
The parsers only; the verbs run in plait.audit.commands.
"""

from __future__ import annotations

from pathlib import Path


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
    p.set_defaults(fn="plait.audit.commands:cmd_pack")
    au = dsub.add_parser("audit", help="label issues (cleanlab), duplicates, outliers, class balance -> audit.json")
    au.add_argument("config", nargs="?", help="TOML config (its [data] and [model] sections are audited)")
    au.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    au.add_argument("--out", required=True, help="folder for audit.json and report.html")
    au.add_argument("--folds", type=int, default=5, help="cross-validation folds for the out-of-fold probabilities")
    au.add_argument("--epochs", type=float, default=10.0, help="passes over each fold's training part")
    au.add_argument("--keep", type=float, default=0.5, help="volume reduction: fraction of the data the coreset keeps")
    au.set_defaults(fn="plait.audit.commands:cmd_audit")
