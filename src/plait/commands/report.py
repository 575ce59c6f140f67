"""`plait report RUN_DIR`: where a run's time went, with a verdict; (re)writes RUN_DIR/report.html."""

from __future__ import annotations

from plait.errors import CheckpointError
from plait.federated.report import write_fed_report
from plait.report import write_report
from plait.report.bottleneck import breakdown, format_report
from plait.rundir import is_federated_run


def cmd_report(a) -> int:
    if not (a.run_dir / "metrics.jsonl").is_file():
        raise CheckpointError(f"{a.run_dir} has no metrics.jsonl; pass the --out directory of a training run")
    if is_federated_run(a.run_dir):  # rounds, not steps: its own report
        print(f"wrote {write_fed_report(a.run_dir)}")
        return 0
    print(format_report(breakdown(a.run_dir)))
    print(f"wrote {write_report(a.run_dir)}")
    return 0
