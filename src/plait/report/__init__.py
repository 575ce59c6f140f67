"""Run reports: plots from metrics.jsonl and an HTML page that shows them with the summary."""

from plait.report.html import write_report

__all__ = ["write_report"]
