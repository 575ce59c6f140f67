"""Starting a training run, as `plait train` and plait.train do: check the job once, write its run directory,
start its workers (or be one of them, when a workload manager started this process).

    code = start_run(config, overrides, out=..., resume=..., dry_run=...)   # the CLI's exit code (plait.api)
    code = launch_checked(cfg, run_dir)                                     # a Config made in code (plait.train)

The job is checked whole once, here (plait.train.job.check_job); config.toml is written with the record that
it was (plait.rundir), and the workers skip the check when they read that same config at that world size.
"""

from __future__ import annotations

import os
from pathlib import Path

from plait.config import Config, auto_notes, dump_config, load_config
from plait.errors import ConfigError
from plait.launch import forkserver, launch
from plait.launch.resume import absolute_paths, check_resume_overrides, fork_run
from plait.launch.role import Role, job_role
from plait.parallel.layout import Layout
from plait.rundir import TRUST_ENV, check_writable_run_dir, timestamped, write_checked_config
from plait.train.job import check_job


def cmd_train(a) -> int:
    """`plait train`'s verb (its parser: plait.cli)."""
    return start_run(a.config, list(a.set), out=a.out, resume=a.resume, dry_run=a.dry_run,
                     trust_checkpoint=a.trust_checkpoint)


def start_run(config: str | Path | None = None, overrides: list[str] | None = None, *, out: str | Path | None = None,
              resume: str | Path | None = None, dry_run: bool = False, trust_checkpoint: bool = False,
              say=print) -> int:
    """`plait train [CONFIG] [--set ...] [--out DIR] [--resume RUN_DIR] [--dry-run]`; returns its exit code."""
    if trust_checkpoint:  # the environment carries it to every worker (the trainer's checkpoint checks read it)
        os.environ[TRUST_ENV] = "1"
    overrides = list(overrides or [])
    if resume and config:
        raise ConfigError("pass either CONFIG or --resume RUN_DIR, not both (a resumed run keeps its own config)")
    try:
        return _start(config, overrides, out, resume, dry_run, say)
    finally:
        forkserver.stop()  # if the job never launched, the fork server warm() started is not left importing


def _start(config, overrides: list[str], out, resume, dry_run: bool, say) -> int:
    if resume:
        role, run_dir = _resumed(Path(resume), overrides, out, warm=not dry_run)
    else:
        role, run_dir = _new(config, overrides, out, warm=not dry_run)
    cfg = role.cfg
    if cfg.launch.backend == "nccl" and not dry_run:
        import torch  # lazily: plait --help must not import torch

        if not torch.cuda.is_available():
            raise ConfigError("launch.backend = 'nccl' needs CUDA GPUs and this machine has none; set "
                              "launch.backend = 'gloo' (or 'auto': nccl on CUDA, else gloo)")
    if resume and not role.worker and not dry_run:
        # every rank would refuse it, each with its own traceback: refuse once, here, before any worker starts
        from plait.train.checkpoint import find_resumable  # lazily: torch's checkpoint reader

        find_resumable(run_dir, log=lambda *_: None, deep=False)
    if role.worker:
        from plait.launch.job import run_worker  # lazily: only a worker trains; the launcher needs no trainer

        run_worker(cfg, run_dir, resume=bool(resume), env=role.env, checked=True)
        return 0
    layout = Layout.from_config(cfg)
    keep = not dry_run or out is not None or resume  # a dry run leaves no run directory unless one is named
    if keep:
        write_checked_config(run_dir, dump_config(cfg), layout.world_size)
    for note in auto_notes(cfg):  # what "auto" became on this machine, before anything starts
        say(f"auto: {note}")
    if dry_run and not keep:
        say(f"config valid; {layout.world_size} process(es); nothing written (give --out DIR to keep its checked "
            "config.toml for torchrun)")
        return 0
    if dry_run:
        say(f"config valid; {layout.world_size} process(es); wrote {run_dir / 'config.toml'}")
        say(f"run it with: torchrun --nproc_per_node {layout.procs_per_node(cfg.max_nodes, cfg.launch.nproc_per_node)} "
            f"-m plait.worker {run_dir}")
        return 0
    return launch(cfg, run_dir, resume=bool(resume))


def _load_job(path: Path | str | None, overrides: list[str], warm: bool) -> Config:
    """load_job, with the workers' fork server started between reading the job and checking it when this process is
    the one that will launch them: its imports (torch, the trainer: seconds) run on the other core while the job is
    checked (declarations only, unless the check builds a model). A dry run (warm False) calls no data.factory: it
    starts nothing, the user's data code included."""
    cfg = load_config(path, overrides)
    if warm and cfg.launch.launcher == "torchrun":
        try:
            launches = not job_role(cfg).worker
            if launches:
                forkserver.warm(cfg)
        except Exception:  # noqa: BLE001 (an unchecked job: check_job, next, names what is wrong with it)
            pass
    if cfg.parallel.auto:
        from plait.plan.auto import choose, needs_plan, vocab_size  # lazily: the planner (torch)

        if needs_plan(cfg):
            cfg = choose(cfg, vocab_size(cfg))
            print(f"parallel.auto: {cfg.parallel.auto_reason}", flush=True)
    check_job(cfg, user_data=warm)
    return cfg


def _resumed(run_dir: Path, overrides: list[str], out: str | Path | None, warm: bool) -> tuple[Role, Path]:
    """--resume RUN_DIR [--out NEW]: the run's own config with the overrides a resume may take; a fork into NEW."""
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"--resume {run_dir}: no config.toml there; pass the --out directory of an earlier run")
    if (run_dir / "partition.json").is_file() and not (run_dir / "checkpoints").exists():
        raise ConfigError(f"--resume {run_dir}: that is a federated run (plait fed), which keeps no training "
                          f"checkpoints to resume; serve its model (plait serve {run_dir}) or start a new run with "
                          "plait train --out NEW")
    saved = load_config(run_dir / "config.toml")
    cfg = _load_job(run_dir / "config.toml", overrides, warm)
    check_resume_overrides(saved, cfg, run_dir)
    role = job_role(cfg)  # a rank of a job torchrun, Slurm, MPI, Kubeflow or Ray started, or plait's launcher
    if out and Path(out).resolve() != run_dir.resolve():
        if role.worker or role.cfg.launch.node_rank != 0:
            raise ConfigError(f"--resume {run_dir} --out {out} forks the run: do that once with plait train, "
                              f"then start the job with --resume {out}")
        run_dir = fork_run(run_dir, Path(out))
    return role, run_dir


def _new(config: str | Path | None, overrides: list[str], out: str | Path | None, warm: bool) -> tuple[Role, Path]:
    """A new run: the job checked whole, its paths absolute, a run directory that overwrites nothing."""
    cfg = _load_job(config, overrides, warm)
    absolute_paths(cfg)
    role = job_role(cfg)
    if out:
        run_dir = Path(out)
    elif role.worker:  # every rank must agree on the name: the manager's job id
        run_dir = Path("runs") / f"{role.env.manager}-{role.env.job_id or 'none'}"
    else:
        run_dir = timestamped()
    first_node = role.cfg.launch.node_rank == 0  # on a shared filesystem the other nodes see node 0's run
    if first_node and not role.worker:
        if (run_dir / "checkpoints").exists():
            raise ConfigError(f"--out {run_dir} already holds a run; continue it with --resume {run_dir} or choose "
                              "another --out")
        check_writable_run_dir(run_dir)
    return role, run_dir


def launch_checked(cfg: Config, run_dir: Path) -> int:
    """Check a job made in code whole, write its checked config.toml into run_dir and run its workers to the end."""
    layout = check_job(cfg)
    write_checked_config(run_dir, dump_config(cfg), layout.world_size)
    return launch(cfg, run_dir)
