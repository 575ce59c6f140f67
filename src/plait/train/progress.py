"""Rank 0's live progress: a rich progress bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, start: int, enabled: bool, unit: str):
        self.enabled = enabled
        self.unit = unit
        self.total = total
        self._bar = None
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
            )
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            self._bar.start()

    def update(self, step: int, loss: float | None, rate: float | None, force_line: bool = False) -> None:
        if not self.enabled:
            return
        info = ""
        if loss is not None:
            info = f"loss {loss:.4f}"
        if rate:
            info += f"  {rate:,.0f} {self.unit}/s"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
        elif force_line:
            print(f"step {step}/{self.total}  {info}", flush=True)

    def note(self, line: str) -> None:
        """A line of its own above the bar (an evaluation's result)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(line, highlight=False)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
