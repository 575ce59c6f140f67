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

from plait.config import load_config
from plait.errors import ConfigError, PlaitError
from plait.parallel.layout import Layout
from plait.train.job import check_job
from plait.train.trainer import train


def fit_to_world(cfg, world: int):
    """An elastic job that lost (or gained) nodes: keep tp, pp and the global batch; dp and accumulation adapt.

    The checkpoint is layout-free, so the run continues on the same trajectory at the new size.
    """
    import copy

    p, t = cfg.parallel, cfg.train
    if world % (p.tp * p.pp):
        raise ConfigError(f"the job now has {world} processes, which tensor ({p.tp}) x pipeline ({p.pp}) parallel "
                          "cannot divide; it cannot continue at this size")
    new = copy.deepcopy(cfg)
    new.parallel.dp = world // (p.tp * p.pp)
    if new.parallel.dp == 1:
        new.parallel.zero, new.parallel.offload, new.parallel.embedding_sharding = 0, "none", "none"
    new.launch.nnodes, new.launch.nproc_per_node, new.launch.node_rank = "1", world, 0
    if t.global_batch_size % (t.micro_batch_size * new.parallel.dp):
        raise ConfigError(
            f"the job now has {world} processes (dp = {new.parallel.dp}), but train.global_batch_size "
            f"({t.global_batch_size}) is not divisible by micro_batch_size ({t.micro_batch_size}) * dp; it cannot "
            "continue at this size (choose a micro batch size that divides the batch at every size)")
    check_job(new)
    return new


def run_worker(run_dir: Path, resume: bool) -> None:
    cfg = load_config(run_dir / "config.toml")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    asked = Layout.from_config(cfg)
    if world != asked.world_size and cfg.elastic:
        cfg = fit_to_world(cfg, world)
        now = Layout.from_config(cfg)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"world size is {world} (the config asks for {asked.world_size}): data parallel "
                  f"{asked.dp} -> {now.dp}, accumulation {asked.grad_accum} -> {now.grad_accum}, "
                  f"global batch {cfg.train.global_batch_size} unchanged", flush=True)
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
        return getattr(e, "exit_code", 2)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
