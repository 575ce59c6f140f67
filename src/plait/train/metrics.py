"""Step timing by phase and the metrics.jsonl writer."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from plait.runtime import synchronize


class PhaseTimer:
    """Wall time per named phase of a step, accumulated over a logging window."""

    def __init__(self, device: torch.device):
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0

    @contextmanager
    def phase(self, name: str):
        synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.totals[name] += time.perf_counter() - t0

    def window(self) -> dict[str, float]:
        """Mean seconds per step for each phase since the last call; resets the window."""
        n = max(1, self.steps)
        out = {k: v / n for k, v in self.totals.items()}
        self.totals.clear()
        self.steps = 0
        return out


class MetricsWriter:
    """Appends one JSON object per line; a resumed run appends to the same file."""

    def __init__(self, path: Path | None):
        self.path = path
        self._f = open(path, "a") if path else None

    def write(self, record: dict) -> None:
        if self._f:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None


def read_metrics(path: Path) -> list[dict]:
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
