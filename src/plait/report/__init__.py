"""Run reports: plots from metrics.jsonl and an HTML page that shows them with the summary.

`write_report` is imported on first use (PEP 562): workers import plait.report.trackers on every run, and only
rank 0 at the end of a run needs matplotlib.
"""

import importlib

from plait.report.runfiles import read_metrics

__all__ = ["read_metrics", "write_report"]


def __getattr__(name: str):
    if name == "write_report":
        return importlib.import_module("plait.report.html").write_report
    raise AttributeError(f"module 'plait.report' has no attribute {name!r}")
