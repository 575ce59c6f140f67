"""The `plait compress` verb: argument parsing only; it runs in plait.compress.commands."""

from __future__ import annotations

from pathlib import Path


def add_parsers(sub, bench) -> None:
    c = sub.add_parser("compress", help="low-rank (SVD) or int8 weights of a trained run, with a before/after table")
    c.add_argument("run_dir", type=Path, help="a run directory (plait train --out)")
    c.add_argument("--low-rank", type=int, metavar="R", help="factorise every Linear layer into rank R (where smaller)")
    c.add_argument("--low-rank-energy", type=float, metavar="E",
                   help="per layer, the smallest rank keeping this share of the squared singular values, e.g. 0.9")
    c.add_argument("--quantize", choices=["int8"], help="int8 weight-only (torchao): int8 weights and per-row scales")
    c.add_argument("-o", "--output", type=Path, help="output .safetensors (default: RUN_DIR/model-lowrank|int8.safetensors)")
    c.set_defaults(fn="plait.compress.commands:cmd_compress")
