"""Step timing by phase and the metrics.jsonl writer (plait.report.read_metrics reads it back)."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from plait.report.trackers import open_trackers, scalars
from plait.runtime import synchronize


class PhaseTimer:
    """Seconds per named phase of a step, accumulated over a logging window, without syncing the host every step.

    On CPU the phases are timed by the host clock. On CUDA each phase records a pair of events and
    their elapsed times are read in `window()`, on logging steps only, so no step waits for the
    device just to be timed. Other accelerators synchronise around each phase.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.events = device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        self.pending: list[tuple[str, Any, Any]] = []  # (phase, start event, end event)
        self.steps = 0

    @contextmanager
    def phase(self, name: str):
        if self.events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self.pending.append((name, start, end))
            return
        if self.device.type != "cpu":
            synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type != "cpu":
                synchronize(self.device)
            self.totals[name] += time.perf_counter() - t0

    def window(self) -> dict[str, float]:
        """Mean seconds per step for each phase since the last call; resets the window."""
        if self.pending:
            self.pending[-1][2].synchronize()
            for name, start, end in self.pending:
                self.totals[name] += start.elapsed_time(end) / 1000.0
            self.pending.clear()
        n = max(1, self.steps)
        out = {k: v / n for k, v in self.totals.items()}
        self.totals.clear()
        self.steps = 0
        return out


class MetricsWriter:
    """Appends one JSON object per line; a resumed run appends to the same file.

    keep_through=S (a run resumed at step S): first drop the records of steps after S, which the resumed run
    replays, and any line a killed writer left half-written, so each step is in the file once, in order.
    """

    def __init__(self, path: Path | None, keep_through: int | None = None, trackers: list[str] | tuple = (),
                 params: dict[str, str] | None = None):
        self.path = path
        # every numeric field of a step's record, as a scalar at that step, to each of log.trackers (rank 0: has a
        # path); `params` (the resolved config, flattened) as the tracker's run parameters
        self._trackers = open_trackers(path.parent, trackers, keep_through, params or {}) if path and trackers else []
        if path and keep_through is not None and path.is_file():
            kept = []
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(record.get("step"), int) or record["step"] <= keep_through:
                    kept.append(line + "\n")
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)
        self._f = open(path, "a") if path else None

    def write(self, record: dict) -> None:
        if self._f:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
        if self._trackers and isinstance(record.get("step"), int):
            found = list(scalars(record))
            for tracker in self._trackers:
                tracker.log(record["step"], found)

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []

