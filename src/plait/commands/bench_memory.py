"""`plait bench memory [CONFIG]`: ZeRO stages 0-3 run in turn, memory per rank against the ZeRO paper's formulas."""

from __future__ import annotations

from plait.config import load_config
from plait.launch.bench_memory import bench_memory
from plait.rundir import timestamped


def cmd_bench_memory(a) -> int:
    base = load_config(a.config, [*a.set, "parallel.zero=0", "parallel.offload='none'"])
    out = a.out or timestamped("bench-memory")
    bench_memory(base, out, a.steps)
    return 0
