"""What `plait bench collectives` does (its parser: plait.comm.cli): local gloo ranks time each collective."""

from __future__ import annotations

from plait.comm.bench import BenchOptions, parse_sizes, run_collectives
from plait.rundir import timestamped


def cmd_bench_collectives(a) -> int:
    opts = BenchOptions(ops=_names(a.ops), algos=_names(a.algos), sizes=parse_sizes(a.sizes, a.factor), ranks=a.ranks,
                        iters=a.iters, warmup=a.warmup, repeats=a.repeats, max_seconds=a.max_seconds,
                        local_size=a.local_size,
                        out=a.out or timestamped("bench-collectives"))
    for line in opts.validate().left_out():
        print(line)
    run_collectives(opts)
    return 0


def _names(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]
