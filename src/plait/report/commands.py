"""What `plait runs compare` does (its parser: plait.report.cli): one page comparing the runs (matplotlib)."""

from __future__ import annotations

from plait.report.compare import compare_runs


def cmd_compare(a) -> int:
    print(f"wrote {compare_runs(a.run_dirs, a.out)}")
    return 0
