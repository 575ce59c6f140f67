"""Run reports: plots from metrics.jsonl and an HTML page that shows them with the summary."""

from plait.report.html import write_report
from plait.report.runfiles import read_metrics

__all__ = ["read_metrics", "write_report"]
