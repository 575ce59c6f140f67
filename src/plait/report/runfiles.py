"""Reading a run directory's files back (metrics.jsonl, summary.json) for reports and tools."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    """Every record of a metrics.jsonl file, in order (none when the file does not exist)."""
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
