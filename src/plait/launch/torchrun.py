"""Start the workers of a job through torchrun's elastic agent (its Python API).

One machine: `launch_torchrun(cfg, run_dir)` starts `nproc_per_node(cfg)` workers with a c10d
rendezvous on a free local port. Several machines: run the same `plait train` on each
with launch.nnodes, launch.node_rank and launch.rdzv_endpoint = node 0's host:port (under Slurm
or Kubernetes plait.launch.role fills them in from the manager's variables).
Each worker does what `python -m plait.worker RUN_DIR` does, forked from a fork server that `plait train` starts
while it checks the job (plait.launch.forkserver: the workers start ready instead of importing torch each); an
asynchronous parameter-server job's workers are spawned as `python -m plait.worker RUN_DIR` (see
_tolerate_dead_workers). The launcher passes only the run directory (which holds the resolved config.toml) and
torchrun's usual environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path

from plait.config import Config
from plait.launch import forkserver, rendezvous
from plait.launch.env import resolve
from plait.launch.exits import DISTRIBUTED_FAILURE_EXIT, USER_ERROR_EXIT
from plait.launch.forkserver import nproc_per_node
from plait.train.checkpoint import latest_checkpoint

_STARTED = time.time()  # when this launcher started (a summary.json older than this is a previous session's)
SHUTDOWN_TIMEOUT_S = 120  # after SIGTERM, workers finish their step and checkpoint within this, then are killed


class _NoTraceback(logging.Filter):
    """The agent's line about a failed worker, without the agent's own traceback (which says only that a process
    exited: report_failure names the rank, and the worker printed why)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        # "failed (exitcode: 1) local_rank: 0": the first process the agent polled, often one that only lost its peer;
        # report_failure and the restart line name the rank that failed first
        return not str(record.msg).startswith("failed (exitcode")


def _quiet_agent() -> None:
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.WARNING)
    api_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, _NoTraceback) for f in api_log.filters):
        api_log.addFilter(_NoTraceback())


def launch_config(cfg: Config, run_dir: Path, start_method: str = "spawn"):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    lc = cfg.launch
    min_nodes, max_nodes = cfg.node_range
    single = max_nodes == 1 and not lc.rdzv_endpoint
    if single:  # no network: the rendezvous and the workers' store on loopback, under a run id nobody can guess
        rendezvous.register()
        endpoint, backend, rdzv_configs = f"{rendezvous.LOOPBACK}:0", rendezvous.BACKEND, {"is_host": True}
    else:
        endpoint, backend = lc.rdzv_endpoint, lc.rdzv_backend
        rdzv_configs = {"rank": lc.node_rank} if backend == "static" else {"is_host": lc.node_rank == 0}
        if backend == "c10d" and resolve().node_rank is None:
            # an elastic Kubeflow pod does not know its node's index: the rendezvous host is the one whose
            # hostname is the endpoint's (torch decides when is_host is left out)
            rdzv_configs = {}
    if backend in ("c10d", rendezvous.BACKEND):
        # Once MIN nodes are there, wait this long for the rest (torch's default is 30 s; a restart
        # after a lost node should not idle that long).
        rdzv_configs["last_call_timeout"] = 5
        rdzv_configs["keep_alive_interval"] = cfg.launch.heartbeat_s
    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc_per_node(cfg),
        run_id=rendezvous.local_run_id(run_dir.resolve().name) if single else f"plait-{run_dir.resolve().name}",
        rdzv_endpoint=endpoint,
        rdzv_backend=backend,
        rdzv_configs=rdzv_configs,
        max_restarts=lc.max_restarts,
        monitor_interval=0.1,
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs")),
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        local_addr=local_addr(cfg) or (rendezvous.LOOPBACK if single else None),
    )


def local_addr(cfg: Config) -> str | None:
    """The address workers of other nodes use to reach this one's store: node 0 is the rendezvous host."""
    lc = cfg.launch
    if lc.local_addr:
        return lc.local_addr
    if cfg.max_nodes > 1 and lc.node_rank == 0 and lc.rdzv_endpoint and resolve().node_rank is not None:
        return lc.rdzv_endpoint.rsplit(":", 1)[0]
    return None


def launch_torchrun(cfg: Config, run_dir: Path, resume: bool = False) -> int:
    """Run the job's workers to completion; returns the exit code for the CLI."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    _quiet_agent()
    forkserver.warm(cfg)  # the workers' environment; the fork server, if `plait train` has not started it already
    from torch.distributed.elastic.multiprocessing import api as mp_api

    mp_api._terminate_process_handler = _interrupt_handler(mp_api._terminate_process_handler, run_dir)
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    _restart_lines(LocalElasticAgent, run_dir)
    if cfg.max_nodes > 1 and cfg.launch.rdzv_endpoint and cfg.launch.node_rank == 0:
        print(rendezvous.exposure_line(cfg.launch.rdzv_endpoint), file=sys.stderr)
    try:
        if forkserver.forks_workers(cfg):
            _release_finished_workers(mp_api.MultiprocessContext)
            elastic_launch(launch_config(cfg, run_dir, "forkserver"), forkserver.run_worker)(str(run_dir), resume)
        else:
            _tolerate_dead_workers(mp_api.SubprocessContext, cfg.parallel.ps_servers)
            elastic_launch(launch_config(cfg, run_dir), sys.executable)(
                "-m", "plait.worker", str(run_dir), *(["--resume"] if resume else []))
    except ChildFailedError as e:
        return report_failure(e, run_dir)
    except mp_api.SignalException as e:
        return report_preemption(run_dir, e)
    finally:
        forkserver.stop()
    return 0


def _release_finished_workers(context_cls) -> None:
    """A forked worker that has finished waits until the agent has read its result. An agent that is stopping its
    workers (SIGTERM, Ctrl-C) signals them and waits for them to exit, reading nothing: the workers that checkpointed
    and finished would sit out the whole shutdown timeout. Stopping, the agent first lets them go."""
    if getattr(context_cls._close, "__plait_releases__", False):
        return
    close = context_cls._close

    def releasing(self, death_sig, timeout: int = 30) -> None:
        note_exits(self)
        self._worker_finished_event.set()
        close(self, death_sig, timeout)

    releasing.__plait_releases__ = True
    context_cls._close = releasing


# global rank -> exit code, for the workers that had ended when the agent began to stop the rest: the agent reports
# one failure (the first it polled), which is often a rank that lost its peer rather than the one that died
EXITED_BEFORE_STOP: dict[int, int] = {}


def note_exits(context) -> None:
    EXITED_BEFORE_STOP.clear()
    processes = getattr(getattr(context, "_pc", None), "processes", None) or []
    for local_rank, proc in enumerate(processes):
        if proc.exitcode is not None:
            env = context.envs.get(local_rank, {}) if isinstance(context.envs, dict) else {}
            EXITED_BEFORE_STOP[int(env.get("RANK", local_rank))] = proc.exitcode


def _restart_lines(agent_cls, run_dir: Path) -> None:
    """One line per restart after a failure (`launch.max_restarts`): which rank ended how, and where it resumes."""
    restart = getattr(agent_cls._restart_workers, "__wrapped_by_plait__", agent_cls._restart_workers)

    def restarting(self, worker_group) -> None:
        if worker_group.state.name in ("FAILED", "UNHEALTHY"):
            spec = worker_group.spec
            killed = _killed()
            failed = sorted((r, c) for r, c in EXITED_BEFORE_STOP.items() if c != 0)
            what = (f"worker rank {killed[0]} was killed by {killed[1]}" if killed else
                    f"worker rank {failed[0][0]} failed with exit code {failed[0][1]}" if failed else "a worker failed")
            ckpt = latest_checkpoint(run_dir)
            print(f"plait: {what}; restart {spec.max_restarts - self._remaining_restarts} of {spec.max_restarts} "
                  f"from {ckpt.name if ckpt else 'the start'}", file=sys.stderr, flush=True)
        restart(self, worker_group)

    restarting.__wrapped_by_plait__ = restart
    agent_cls._restart_workers = restarting


def _tolerate_dead_workers(context_cls, servers: int) -> None:
    """An asynchronous (or SSP) parameter-server job goes on without a worker that dies: torch's agent ends the whole
    job when any process fails, so a failure of a worker other than the chief (global ranks 1 .. WORLD_SIZE - servers
    - 1, at whatever size an elastic job now has; the chief writes the run, the servers hold it) is noted and dropped
    before the agent sees it. The servers already count the worker out (its last update is its last); the job ends
    when every other process has."""
    if getattr(context_cls._capture_process_failures, "__plait_tolerant__", None) == servers:
        return
    capture = getattr(context_cls._capture_process_failures, "__wrapped__", context_cls._capture_process_failures)

    def tolerant(self, done_local_ranks: set[int]):
        capture(self, done_local_ranks)
        for local_rank in list(self._failures):
            env = self.envs[local_rank]
            rank, world = int(env.get("RANK", -1)), int(env.get("WORLD_SIZE", 0))
            if 1 <= rank < world - servers:
                code = self._failures.pop(local_rank).exitcode
                print(f"plait: worker rank {rank} ended (exit code {code}); the asynchronous parameter-server job "
                      "goes on without it", file=sys.stderr, flush=True)

    tolerant.__wrapped__ = capture
    tolerant.__plait_tolerant__ = servers
    context_cls._capture_process_failures = tolerant


def _interrupt_handler(torch_handler, run_dir: Path):
    """Wrap the agent's signal handler (torch's raises SignalException, and the agent forwards the signal to its
    workers, which stop at the next logging step and checkpoint). The first Ctrl-C says so; a second one kills the
    workers at once: they run in sessions of their own, so the terminal's SIGINT reaches only this process."""
    interrupts = 0

    def handler(signum, frame):
        nonlocal interrupts
        if signum == signal.SIGINT:
            interrupts += 1
            if interrupts > 1:
                for pid in _descendants():  # forked workers are the fork server's children, in sessions of their own
                    with contextlib.suppress(OSError):
                        os.killpg(pid, signal.SIGKILL)
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                ckpt = latest_checkpoint(run_dir)
                print("\ninterrupted again: workers killed" + (f"; the latest checkpoint is {ckpt.name}, continue with "
                      f"plait train --resume {run_dir}" if ckpt else ""), file=sys.stderr, flush=True)
                os._exit(128 + signal.SIGINT)
            print("\ninterrupted: the workers stop at the next logging step and checkpoint (Ctrl-C again to stop at "
                  "once, losing the steps since the last checkpoint)", file=sys.stderr, flush=True)
        torch_handler(signum, frame)

    return handler


def _descendants() -> list[int]:
    """This process's children, their children and so on (Linux /proc; empty elsewhere)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    out, frontier = [], {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier}
        out += sorted(frontier)
    return out


def report_preemption(run_dir: Path, e) -> int:
    """SIGTERM to the job: the workers checkpointed and stopped; say so and exit 0 (or 1 if nothing was saved)."""
    import json

    summary = run_dir / "summary.json"
    # this session's summary only (a resumed run's folder holds the previous session's)
    done = json.loads(summary.read_text()) if summary.is_file() and summary.stat().st_mtime >= _STARTED else {}
    preempted = done.get("preempted")
    ckpt = latest_checkpoint(run_dir)
    if done and not preempted:  # the signal came as the run was closing: nothing is lost
        print(f"{e.sigval.name} arrived after the run finished (step {done.get('steps')}); nothing to resume",
              flush=True)
        return 0
    if preempted and ckpt is not None:
        if done.get("stop_said"):  # rank 0 printed this very line, with the checkpoint and the resume command
            return 0
        what = "interrupted (Ctrl-C)" if e.sigval == signal.SIGINT else f"preempted ({e.sigval.name})"
        print(f"{what}: stopped cleanly at {ckpt.name}; continue with "
              f"plait train --resume {run_dir}", flush=True)
        return 0
    print(f"error: stopped by {e.sigval.name} before a checkpoint was written"
          + (f"; the latest is {ckpt.name}" if ckpt else ""), file=sys.stderr)
    return 1


def _killed() -> tuple[int, str] | None:
    """The first rank that a signal ended before the agent stopped the job (SIGKILL, the out-of-memory killer, ...)."""
    killed = sorted((r, -c) for r, c in EXITED_BEFORE_STOP.items() if c < 0 and -c != signal.SIGTERM)
    if not killed:
        return None
    rank, sig = killed[0]
    try:
        return rank, signal.Signals(sig).name
    except ValueError:
        return rank, f"signal {sig}"


def next_step(run_dir: Path | None) -> str:
    if run_dir is None:
        return ""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return "; no checkpoint was written yet: start it again"
    return f"; the latest checkpoint is {ckpt.name}: continue with plait train --resume {run_dir}"


def report_failure(e, run_dir: Path | None = None) -> int:
    """One short message for the CLI: user errors were already printed by the worker. A rank killed by a signal is
    named as the cause (the others only lost their peer), with the latest checkpoint and the resume command."""
    failures = e.failures
    killed = _killed()
    if killed is not None:
        rank, how = killed
        print(f"error: worker rank {rank} was killed by {how} (from outside plait: the out-of-memory killer, a user "
              f"or the scheduler); the other ranks stopped with it{next_step(run_dir)}", file=sys.stderr)
        return 1
    codes = {f.exitcode for f in failures.values()}
    for code in (USER_ERROR_EXIT, DISTRIBUTED_FAILURE_EXIT):  # the worker has printed what went wrong
        if code in codes:
            return code
    rank, failure = min(failures.items())
    msg = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
    code = failure.exitcode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else \
        f"failed with exit code {code}"
    print(f"error: worker rank {rank} {how}", file=sys.stderr)
    if msg and not msg.startswith("To enable traceback"):
        print(msg.strip()[-4000:], file=sys.stderr)
    if failure.error_file and os.path.exists(failure.error_file):
        print(f"(full error: {failure.error_file})", file=sys.stderr)
    if run_dir is not None:
        print(f"next: {next_step(run_dir)[2:]}", file=sys.stderr)
    return 1
