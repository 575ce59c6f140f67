"""Optional torch.profiler traces of chosen steps, one Chrome trace per rank (log.profile_steps = [first, last])."""

from __future__ import annotations

from pathlib import Path

import torch


class StepProfiler:
    def __init__(self, steps: list, run_dir: Path | None, rank: int, device: torch.device):
        self.first, self.last = (int(steps[0]), int(steps[-1])) if steps else (0, -1)
        self.out = (run_dir / "traces" / f"rank{rank}.json") if run_dir is not None else None
        self.device = device
        self._prof: torch.profiler.profile | None = None

    def begin(self, step: int) -> None:
        """Call as step `step` (1-based) begins."""
        if step == self.first and self.out is not None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.__enter__()

    def end(self, step: int) -> None:
        """Call when step `step` is done; writes the trace after the last profiled step."""
        if self._prof is not None and step >= self.last:
            self._prof.__exit__(None, None, None)
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self._prof.export_chrome_trace(str(self.out))
            self._prof = None
