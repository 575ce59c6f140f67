"""The `plait compress` verb (argument parsing only; the work is imported when it runs)."""

from __future__ import annotations

from pathlib import Path

from plait.errors import ConfigError


def cmd_compress(a) -> int:
    chosen = [x for x in (a.low_rank is not None, a.low_rank_energy is not None, a.quantize is not None) if x]
    if len(chosen) != 1:
        raise ConfigError("plait compress takes one of --low-rank R, --low-rank-energy E or --quantize int8")
    if a.low_rank is not None and a.low_rank < 1:
        raise ConfigError(f"--low-rank {a.low_rank} must be >= 1")
    if a.low_rank_energy is not None and not 0 < a.low_rank_energy <= 1:
        raise ConfigError(f"--low-rank-energy {a.low_rank_energy} must be in (0, 1], e.g. 0.9")
    from plait.compress.core import compress_int8, compress_low_rank  # lazily: plait --help must not import torch

    out = a.output or a.run_dir / ("model-int8.safetensors" if a.quantize else "model-lowrank.safetensors")
    if a.quantize:
        report = compress_int8(a.run_dir, out)
    else:
        report = compress_low_rank(a.run_dir, out, rank=a.low_rank, energy=a.low_rank_energy)
    print(report["table"])
    print(f"wrote {out}")
    return 0


def add_parsers(sub, bench) -> None:
    c = sub.add_parser("compress", help="low-rank (SVD) or int8 weights of a trained run, with a before/after table")
    c.add_argument("run_dir", type=Path, help="a run directory (plait train --out)")
    c.add_argument("--low-rank", type=int, metavar="R", help="factorise every Linear layer into rank R (where smaller)")
    c.add_argument("--low-rank-energy", type=float, metavar="E",
                   help="per layer, the smallest rank keeping this share of the squared singular values, e.g. 0.9")
    c.add_argument("--quantize", choices=["int8"], help="int8 weight-only (torchao): int8 weights and per-row scales")
    c.add_argument("-o", "--output", type=Path, help="output .safetensors (default: RUN_DIR/model-lowrank|int8.safetensors)")
    c.set_defaults(fn=cmd_compress)
