"""Worker entry point: `python -m plait.worker RUN_DIR [--resume]`, one per process.

plait's launcher starts it through torchrun's agent; it also runs under a plain
`torchrun --nproc_per_node N -m plait.worker RUN_DIR` once RUN_DIR/config.toml exists
(`plait train --dry-run --out RUN_DIR` writes it), and as one rank started by any manager that
plait.launch.env knows (srun, mpirun, a Kubeflow pod). After a restart by the agent (or a requeue)
it resumes from the run's latest checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from plait.launch.job import fit_to_world, run_worker_dir, worker_process

__all__ = ["fit_to_world", "main", "run_worker"]


def run_worker(run_dir: Path, resume: bool) -> None:
    run_worker_dir(run_dir, resume)


@record
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m plait.worker")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args(argv)
    return worker_process(a.run_dir, a.resume)


if __name__ == "__main__":
    from plait.exiting import exit_now  # the entry point only: main() itself returns, for callers in-process

    exit_now(main())
