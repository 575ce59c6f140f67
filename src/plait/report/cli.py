"""`plait runs compare RUN... [--out DIR]` (registered by plait.cli through add_parsers); it runs in
plait.report.commands."""

from __future__ import annotations

from pathlib import Path


def add_parsers(sub, bench) -> None:
    r = sub.add_parser("runs", help="look at several runs together")
    rsub = r.add_subparsers(dest="runs_verb", required=True, metavar="ACTION")
    c = rsub.add_parser("compare", help="one HTML page: a table of the runs' figures and their loss curves overlaid")
    c.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="two or more run directories")
    c.add_argument("--out", type=Path, help="where compare.html and compare.png go (default: runs/compare-<time>)")
    c.set_defaults(fn="plait.report.commands:cmd_compare")
