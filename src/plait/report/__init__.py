"""Run reports: plots from metrics.jsonl and an HTML page that shows them with the summary.

`write_report` is imported on first use (PEP 562): workers import plait.report.trackers on every run, and only
rank 0 at the end of a run needs matplotlib.
"""

from plait.report.runfiles import read_metrics

__all__ = ["read_metrics", "write_report"]


def __getattr__(name: str):
    if name == "write_report":
        from plait.report.html import write_report  # lazily (PEP 562)

        return write_report
    raise AttributeError(f"module 'plait.report' has no attribute {name!r}")
