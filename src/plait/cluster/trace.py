"""Job traces: read one from CSV, or draw a synthetic one shaped like the published cluster traces.

A trace CSV has a header and one job per row: `arrival` (seconds), `devices`, `duration` (seconds of work at that
many devices) and optionally `id`. The synthetic generator follows what Microsoft's Philly and Alibaba's PAI traces
show and the scheduling papers (Tiresias, Gandiva, Pollux) use: Poisson arrivals, mostly single-device jobs with a
tail of 8-32-device ones, and heavy-tailed (log-normal) durations — most jobs take minutes, a few take days.
"""

from __future__ import annotations

import csv
import math
import random
from pathlib import Path

from plait.cluster.sim import TraceJob
from plait.errors import ConfigError

SIZES = (1, 2, 4, 8, 16, 32)
SIZE_WEIGHTS = (0.50, 0.15, 0.15, 0.12, 0.05, 0.03)
MEDIAN_S = 900.0  # median duration: 15 minutes
SIGMA = 1.8  # log-normal spread: p99 is ~65x the median
MAX_S = 3 * 86400.0


def synthetic(n: int, devices: int, seed: int = 0, load: float = 0.9) -> list[TraceJob]:
    """`n` jobs whose offered load (device-seconds asked per second) is `load` x `devices`."""
    if n < 1:
        raise ConfigError(f"--synthetic {n}: give at least 1 job")
    if not 0 < load:
        raise ConfigError(f"--load {load}: give a positive load (0.9 = the cluster 90 % busy on average)")
    rng = random.Random(seed)
    sizes = [s for s in SIZES if s <= devices]
    weights = SIZE_WEIGHTS[:len(sizes)]
    jobs = []
    for _ in range(n):
        g = rng.choices(sizes, weights)[0]
        d = min(MAX_S, max(30.0, rng.lognormvariate(math.log(MEDIAN_S), SIGMA)))
        jobs.append((g, d))
    mean_work = sum(g * d for g, d in jobs) / n
    rate = load * devices / mean_work  # arrivals per second
    t = 0.0
    out = []
    for i, (g, d) in enumerate(jobs):
        out.append(TraceJob(f"j{i}", round(t, 3), g, round(d, 3)))
        t += rng.expovariate(rate)
    return out


def read_trace(path: Path) -> list[TraceJob]:
    """Jobs from a CSV; a bad cell is named by file, row and column."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"trace {path} does not exist")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ConfigError(f"trace {path} has no jobs (a header, then one row per job)")
    missing = [c for c in ("arrival", "devices", "duration") if c not in rows[0]]
    if missing:
        raise ConfigError(f"trace {path} has no column {missing[0]!r}; its columns are {', '.join(rows[0])} "
                          f"(needed: arrival, devices, duration; optional: id)")
    out = [TraceJob(row.get("id") or f"row{n}", _cell(path, n, row, "arrival", float),
                    _cell(path, n, row, "devices", int), _cell(path, n, row, "duration", float))
           for n, row in enumerate(rows, start=2)]  # row 1 is the header
    ids = [j.id for j in out]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ConfigError(f"trace {path}: job id {dup!r} appears twice; ids must be unique")
    return out


def _cell(path: Path, n: int, row: dict, col: str, kind):
    try:
        v = kind(row[col])
    except (TypeError, ValueError):
        raise ConfigError(f"{path}, row {n}, column {col}: {row[col]!r} is not a "
                          f"{'whole number' if kind is int else 'number'}") from None
    if v < 0 or (col != "arrival" and v <= 0):
        raise ConfigError(f"{path}, row {n}, column {col}: {v} must be {'>= 0' if col == 'arrival' else '> 0'}")
    return v


def write_trace(jobs: list[TraceJob], path: Path) -> None:
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "arrival", "devices", "duration"])
        for j in jobs:
            w.writerow([j.id, j.arrival, j.devices, j.duration])
