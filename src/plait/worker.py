"""Worker entry point: `python -m plait.worker RUN_DIR [--resume]`, one per process.

plait's launcher starts it through torchrun's agent; it also runs under a plain
`torchrun --nproc_per_node N -m plait.worker RUN_DIR` once RUN_DIR/config.toml exists
(`plait train --dry-run --out RUN_DIR` writes it). After a restart by the agent it
resumes from the run's latest checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from plait.errors import PlaitError


def run_worker(run_dir: Path, resume: bool) -> None:
    from plait.config import load_config
    from plait.train.trainer import train

    cfg = load_config(run_dir / "config.toml")
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    train(cfg, run_dir, resume=resume or restarted)


@record
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m plait.worker")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args(argv)
    try:
        run_worker(a.run_dir, a.resume)
    except PlaitError as e:
        rank = int(os.environ.get("RANK", "0"))
        prefix = f"[rank {rank}] " if rank else ""
        print(f"{prefix}error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
