"""One worker of a job, whatever started it: fit the config to the world the manager gives, then train.

    run_worker(cfg, run_dir, resume, env)     # env: plait.launch.env.resolve() (torchrun, Slurm, MPI, Ray, ...)
    run_worker_dir(run_dir, resume)           # the same with RUN_DIR/config.toml
    code = worker_process(run_dir, resume)    # a worker process's whole life: python -m plait.worker, a forked one

A manager other than torchrun states rank, world size and rank 0's address in its own variables; they are
exported as torch's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT before the process group forms
(plait.runtime reads only those). A world size that is not the layout's stops the worker before it trains,
with both numbers (an elastic config adapts data parallel instead, keeping the global batch).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from plait.config import Config, load_config
from plait.errors import ConfigError, PlaitError
from plait.launch.env import ClusterEnv, resolve
from plait.launch.exits import USER_ERROR_EXIT
from plait.parallel.layout import Layout, resized
from plait.plan.auto import vocab_size
from plait.plan.replan import describe, layout_of, replan
from plait.rundir import checked_config
from plait.train.job import check_job


def fit_to_world(cfg: Config, world: int) -> Config:
    """An elastic job that lost (or gained) nodes: every degree but dp kept (Layout.resolve), and the global batch;
    dp and accumulation adapt.

    The checkpoint is layout-free, so the run continues on the same trajectory at the new size.
    """
    new = resized(cfg, world, "the resized job's WORLD_SIZE")
    new.launch.nnodes, new.launch.nproc_per_node, new.launch.node_rank = "1", world, 0
    t = new.train
    if t.global_batch_size % (t.micro_batch_size * new.parallel.dp):
        raise ConfigError(
            f"the job now has {world} processes (dp = {new.parallel.dp}), but train.global_batch_size "
            f"({t.global_batch_size}) is not divisible by micro_batch_size ({t.micro_batch_size}) * dp; it cannot "
            "continue at this size (choose a micro batch size that divides the batch at every size)")
    check_job(new)
    return new


def fit(cfg: Config, env: ClusterEnv) -> Config:
    """The config this rank trains with: as written, or resized for an elastic job; else a mismatch is an error."""
    asked = Layout.from_config(cfg)
    world = env.world_size or 1
    if world == asked.world_size:
        return cfg
    if not cfg.elastic:
        Layout.resolve(cfg, world, where=env.world_source())  # raises, showing the arithmetic
    if cfg.launch.on_resize == "replan":
        try:
            fit_to_world(cfg, world)
        except ConfigError as e:

            new, why = replan(cfg, world, vocab_size(cfg))
            if not env.rank:
                print(f"world size is {world} (the config asks for {asked.world_size}): {describe(layout_of(cfg))} "
                      f"cannot continue ({e}); replanned (launch.on_resize = 'replan'): {why}, global batch "
                      f"{cfg.train.global_batch_size} unchanged", flush=True)
            return new
    cfg = fit_to_world(cfg, world)
    now = Layout.from_config(cfg)
    if not env.rank:
        print(f"world size is {world} (the config asks for {asked.world_size}): data parallel "
              f"{asked.dp} -> {now.dp}, accumulation {asked.grad_accum} -> {now.grad_accum}, "
              f"global batch {cfg.train.global_batch_size} unchanged", flush=True)
    return cfg


def export_env(env: ClusterEnv) -> None:
    """torch's variables from the manager's (torchrun and Ray Train have set them already)."""
    if env.manager in ("torchrun", "none"):
        return
    os.environ.update({"RANK": str(env.rank), "WORLD_SIZE": str(env.world_size), "LOCAL_RANK": str(env.local_rank or 0),
                       "MASTER_ADDR": env.master_addr, "MASTER_PORT": str(env.master_port)})
    if env.local_world_size:
        os.environ["LOCAL_WORLD_SIZE"] = str(env.local_world_size)
    if env.nnodes == "1" and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # all ranks on this machine: loopback (choosing by hostname is flaky)


def note_session(run_dir: Path | None, env: ClusterEnv) -> None:
    """A line in metrics.jsonl for each session of the run: which manager, how often restarted or requeued."""
    if run_dir is None or env.rank not in (0, None):
        return
    record = {"event": "session", "manager": env.manager, "world_size": env.world_size, "restart_count": env.restart_count,
              "unix_time": round(time.time(), 3)}
    latest = run_dir / "checkpoints" / "latest"
    if latest.is_symlink():  # a resumed session: how long since the checkpoint it continues from was published
        record["since_checkpoint_s"] = round(time.time() - latest.lstat().st_mtime, 3)
    if os.environ.get("SLURM_JOB_ID"):  # also when torchrun's agent runs inside a Slurm job (plait's job.sbatch)
        record.update(slurm_job_id=os.environ["SLURM_JOB_ID"],
                      slurm_restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def run_worker(cfg: Config, run_dir: Path | None, resume: bool = False, env: ClusterEnv | None = None,
               own_process_group: bool = True, checked: bool = False):
    """Train as one rank of the job `env` describes; returns the trainer's result.

    own_process_group: leave no process group behind (Ray Train, which made it, tears it down itself). A rank that
    exits with its group alive can abort in torch's shutdown once rank 0, the store's host, is gone. checked: the
    launcher checked this config whole (plait.rundir); a config resized to another world is checked again.
    """
    from plait.train.trainer import train  # lazily: importing the trainer takes seconds

    env = env or resolve()
    fitted = fit(cfg, env)
    checked, cfg = checked and fitted is cfg, fitted
    export_env(env)
    note_session(run_dir, env)
    restarted = env.restart_count > 0  # torchrun restarted the workers, Slurm requeued the job, Ray retried
    # An elastic job's workers also restart when a node joins or leaves, and torch counts that as no restart. A new
    # run's directory holds no checkpoint (plait train refuses one that does), so one found here is this job's.
    restarted = restarted or cfg.node_range[0] < cfg.node_range[1]
    finished = False
    try:
        result = train(cfg, run_dir, resume=resume or restarted, checked=checked)
        finished = True
        return result
    finally:
        if own_process_group:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                # every rank meets before leaving: gloo aborts a rank whose peer closes a pair it still uses
                # ("terminate called without an active exception" once, after a pipeline run). Not a parameter
                # server's ranks: one may have died (async) and the others go on without it.
                if finished and cfg.parallel.sync != "ps":
                    dist.barrier()
                dist.destroy_process_group()


def run_worker_dir(run_dir: Path, resume: bool = False, env: ClusterEnv | None = None, own_process_group: bool = True):
    """run_worker with RUN_DIR/config.toml; the launcher's whole check is not repeated when the file is what it
    checked, for this world size."""
    env = env or resolve()
    checked = checked_config(run_dir, env.world_size or 1)
    return run_worker(load_config(run_dir / "config.toml"), run_dir, resume, env, own_process_group, checked=checked)


def worker_process(run_dir: Path, resume: bool = False) -> int:
    """A worker process's whole life (`python -m plait.worker`, or forked by plait.launch.forkserver): train from
    RUN_DIR; an error the user can fix as one line on stderr and its exit code; the process group destroyed."""
    try:
        run_worker_dir(run_dir, resume)
    except PlaitError as e:
        rank = int(os.environ.get("RANK", "0") or 0)
        prefix = f"[rank {rank}] " if rank else ""
        print(f"{prefix}error: {e}", file=sys.stderr, flush=True)
        return getattr(e, "exit_code", USER_ERROR_EXIT)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
