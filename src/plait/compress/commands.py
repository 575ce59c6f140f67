"""What `plait compress RUN_DIR` does (its parser: plait.compress.cli): one of low-rank or int8, a before/after table."""

from __future__ import annotations

from plait.compress.core import compress_int8, compress_low_rank
from plait.errors import ConfigError


def cmd_compress(a) -> int:
    chosen = [x for x in (a.low_rank is not None, a.low_rank_energy is not None, a.quantize is not None) if x]
    if len(chosen) != 1:
        raise ConfigError("plait compress takes one of --low-rank R, --low-rank-energy E or --quantize int8")
    if a.low_rank is not None and a.low_rank < 1:
        raise ConfigError(f"--low-rank {a.low_rank} must be >= 1")
    if a.low_rank_energy is not None and not 0 < a.low_rank_energy <= 1:
        raise ConfigError(f"--low-rank-energy {a.low_rank_energy} must be in (0, 1], e.g. 0.9")
    out = a.output or a.run_dir / ("model-int8.safetensors" if a.quantize else "model-lowrank.safetensors")
    if a.quantize:
        report = compress_int8(a.run_dir, out)
    else:
        report = compress_low_rank(a.run_dir, out, rank=a.low_rank, energy=a.low_rank_energy)
    print(report["table"])
    print(f"wrote {out}")
    return 0
