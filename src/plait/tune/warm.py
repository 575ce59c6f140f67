"""Warm trials: a one-process trial forked, ready to train, from an interpreter that has imported torch and plait.

A trial run as `plait train` pays a new interpreter, torch's import, the launcher and torchrun's agent before its
first step: about 2.5 s on 2 cores around a 40-step digits job that trains for 0.1 s. When the trial's layout is one
process on this machine (the usual search), `plait tune` instead

1. checks the trial's job here, in the tuner (what `plait train` checks: the config, the model, the data), and writes
   its run dir and checked config.toml;
2. forks its worker from the multiprocessing fork server that plait.launch.forkserver starts once per study (it has
   imported plait.worker and the trainer), with the environment a launcher gives a rank of a one-process job;
3. reads it as it reads a `plait train` process: the same metrics.jsonl and summary.json, SIGTERM to prune (the
   worker checkpoints and exits 0), its output in the trial's log.

The run dir holds what `plait train` would have written, so a trial resumes, exports and serves as any run. Any other
layout, launcher or a study driven from a user's script (multiprocessing would run the script's __main__ again in
the child) runs `plait train` as before.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from plait.config import Config, dump_config, load_config
from plait.errors import PlaitError
from plait.launch.forkserver import _main_is_plait, warm, worker_env
from plait.launch.job import worker_process
from plait.launch.resume import absolute_paths
from plait.parallel.layout import Layout
from plait.rundir import check_writable_run_dir, write_checked_config
from plait.train.job import check_job


def applies(cfg: Config) -> bool:
    """Whether a trial of this job can run warm: one process on this machine, torchrun's launcher, no auto layout."""
    return (cfg.launch.launcher == "torchrun" and cfg.max_nodes == 1 and not cfg.parallel.auto
            and Layout.from_config(cfg).world_size == 1)


def can_fork() -> bool:
    """Whether this process may fork trials: `plait tune` itself, not a user's script (its __main__ would run again
    in every child multiprocessing starts)."""
    return _main_is_plait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WarmTrial:
    """A forked one-process trial with the subprocess.Popen methods the tuner uses (poll, send_signal, wait,
    returncode)."""

    def __init__(self, config: str | None, sets: list[str], run: Path, log: Path, env: dict[str, str] | None,
                 name: str):
        import multiprocessing

        cfg = load_config(config, sets)
        absolute_paths(cfg)
        check_job(cfg)
        check_writable_run_dir(run)
        write_checked_config(run, dump_config(cfg), 1)
        warm(cfg)  # once per study: later trials find the fork server running
        child_env = {**(env if env is not None else os.environ), **worker_env(cfg),
                     "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                     "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(free_port()), "TORCHELASTIC_RUN_ID": name, "TORCHELASTIC_RESTART_COUNT": "0"}
        self.proc = multiprocessing.get_context("forkserver").Process(
            target=trial_main, args=(str(run), str(log), child_env), name=name)
        self.proc.start()

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self.proc.pid is not None and self.proc.exitcode is None:
            os.kill(self.proc.pid, sig)

    def wait(self) -> int:
        self.proc.join()
        return self.proc.exitcode or 0


def trial_main(run: str, log: str, env: dict[str, Any]) -> None:
    """The forked trial: the worker of a one-process `plait train`, its output to the trial's log."""
    import atexit

    os.setsid()  # as a launched worker: a terminal's Ctrl-C reaches the tuner, which stops its trials
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the fork server ignores it (plait.launch.forkserver)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    try:
        code = worker_process(Path(run))
    except PlaitError as e:  # worker_process prints its own; this is the belt for anything raised around it
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    atexit._run_exitfuncs()  # a forked child runs no atexit handlers at its end: the trackers' run here
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        sys.exit(code)
