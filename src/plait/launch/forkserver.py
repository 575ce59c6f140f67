"""Workers forked from a warm interpreter, started while the launcher checks the job.

Spawned, a worker is a new interpreter that spends about 3.5 s (2 cores) importing torch and plait before it trains,
and every worker of every start and restart pays it. Instead, `warm(cfg)` starts multiprocessing's fork server as
soon as the launcher has read the job: it imports plait.worker (torch, the trainer) on one core while the launcher
checks the job on the other, and torchrun's agent then starts each worker by forking it (start method
"forkserver"), ready in a fraction of a second. A fork server rather than a fork of the agent: it is single-threaded
and never touched CUDA, so its children may use the GPU and hold none of the agent's locks.

The server itself is forked from the launcher once the launcher has imported torch (which it needs for the agent),
before the launcher starts a thread or touches a device: torch is then imported once, not again by a new interpreter
(~1.5 s of CPU a launch: the test suite launches some hundred jobs). The child is made what a new server would be:
only the listener, its pipe and stdio left open, Python signal handlers back to their defaults, its own lock; it
never returns into the launcher's code (os._exit). Where the launcher already runs other threads, the server is
spawned as multiprocessing does it.

Only where plait owns the process (`plait train`, `python -m plait`): multiprocessing runs the parent's __main__
in every child it starts, and a user's script calling plait.train would run again there, so plait.train in a
script keeps spawned workers (forks_workers).

The fork server's environment is the launcher's at `warm` (the workers' defaults, `worker_env`, are set just
before), and `stop()` ends it with the launch, so that a later launch in the same process starts one with the
environment of then. This module imports no torch at its import.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
from multiprocessing import connection, forkserver, resource_tracker, util
from pathlib import Path
from typing import NoReturn

from plait.config import Config
from plait.parallel.layout import Layout
from plait.parallel.schemes import implementation_modules  # the schemes' declarations: no torch

_OUTLIVED = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # what the fork server ignores (see warm)
PRELOAD = ["plait.worker", "plait.train.trainer", "torch._dynamo"]  # what every worker imports before it trains (DDP: dynamo)


def nproc_per_node(cfg: Config) -> int:
    """Worker processes on this machine: launch.nproc_per_node, or the layout's processes spread over the nodes."""
    return Layout.from_config(cfg).procs_per_node(cfg.max_nodes, cfg.launch.nproc_per_node)


def worker_env(cfg: Config) -> dict[str, str]:
    """Environment defaults for workers (only where the user has not set them)."""
    layout = Layout.from_config(cfg)
    env = {}
    if "OMP_NUM_THREADS" not in os.environ:
        procs = layout.procs_per_node(cfg.max_nodes, cfg.launch.nproc_per_node)
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // procs))
    if cfg.max_nodes == 1 and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # interface choice by hostname is flaky; one machine needs only loopback
    if layout.elastic and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ:
        # A node joining a running elastic job restarts the workers with more ranks. With the agent's rendezvous
        # store shared with the workers (torch's default), that restart waits forever on keys each agent wrote
        # where the other does not look (torch 2.13; plain torchrun --nnodes 1:2 does the same): give the workers
        # a store of their own.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def forks_workers(cfg: Config) -> bool:
    """Whether this job's workers are forked from the fork server. Not for an asynchronous parameter-server job with
    dedicated servers: it outlives a dead worker, which the launcher tolerates only for spawned ones
    (plait.launch.torchrun). Nor when this process runs a user's script (plait.train(...) in it): multiprocessing
    runs the parent's __main__ in each child before it starts, and the script would train again."""
    p = cfg.parallel
    return _main_is_plait() and not (p.sync == "ps" and p.ps_mode in ("async", "ssp") and p.ps_placement == "dedicated")


def _main_is_plait() -> bool:
    """Whether a forked child would run no user code as __main__: `python -m plait`, the `plait` script (its body is
    under `if __name__ == "__main__"`), or an interpreter with no main file (a REPL, `python -c`)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return spec.name == "plait.__main__"
    path = getattr(main, "__file__", None)
    return path is None or Path(path).resolve() == (Path(sys.executable).parent / "plait").resolve()


def warm(cfg: Config) -> None:
    """Set the workers' environment and start the fork server importing plait.worker, if this job forks its workers
    (a no-op when it is running already)."""
    os.environ.update(worker_env(cfg))
    if not forks_workers(cfg):
        return
    # and the job's schemes' implementations (DDP's hooks, pipelining, ...): imported once here, not by each worker
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD + implementation_modules(cfg))
    # The agent hears of its workers' ends through the fork server: it must outlive a signal to the launcher's
    # process group (Slurm's SIGTERM to a job step, a terminal's hangup), which the agent forwards to the workers
    # itself. Ignored signals stay ignored across exec; the workers take the default back (run_worker).
    main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _OUTLIVED} if main else {}
    try:
        if main and threading.active_count() == 1:
            _fork_server()
        else:
            forkserver.ensure_running()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _fork_server() -> None:
    """multiprocessing's ForkServer.ensure_running, with the server forked from this process (torch imported) where
    multiprocessing spawns a new interpreter for it. Same listener, pipe and bookkeeping: the agent's requests, the
    workers' exit codes and stop() work alike."""
    import torch  # noqa: F401  (what launcher and server both need: imported once, before the fork)
    import torch.distributed  # noqa: F401

    server = forkserver._forkserver
    with server._lock:
        resource_tracker.ensure_running()
        if server._forkserver_pid is not None:
            if not os.waitpid(server._forkserver_pid, os.WNOHANG)[0]:
                return  # running already
            os.close(server._forkserver_alive_fd)
            server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
        preload = list(server._preload_modules)
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()  # the launcher and the workers hold the write end; EOF ends the server
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()  # or the workers would write the launcher's unflushed output again
            pid = os.fork()
            if pid == 0:
                _serve(listener.fileno(), alive_r, preload)  # never returns
            os.close(alive_r)
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def _serve(listener_fd: int, alive_r: int, preload: list[str]) -> NoReturn:
    """The forked server: the launcher's state that a new interpreter would not have is dropped, then
    multiprocessing's own server loop runs until the launcher and every worker have ended."""
    code = 0
    try:
        forkserver._forkserver._lock = threading.Lock()  # held by the launcher at the fork
        keep = sorted({0, 1, 2, listener_fd, alive_r})
        for lo, hi in zip([2, *keep], [*keep, os.sysconf("SC_OPEN_MAX")]):
            if 3 <= lo + 1 < hi:  # (an empty range may close all: close_range(lo, hi - 1) with hi - 1 = -1)
                os.closerange(lo + 1, hi)  # what spawning closes: every other file the launcher had open
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        for sig in signal.valid_signals():
            with contextlib.suppress(OSError, ValueError, TypeError):
                if callable(signal.getsignal(sig)):
                    signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        forkserver.main(listener_fd, alive_r, preload)
    except SystemExit:
        pass
    except BaseException:  # noqa: BLE001 (reported here: the launcher sees only a server that ended)
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def run_worker(run_dir: str, resume: bool) -> None:
    """One worker, forked from the fork server: what `python -m plait.worker RUN_DIR [--resume]` does."""
    os.setsid()  # a session of its own, as a spawned worker's: a terminal's Ctrl-C reaches only the launcher
    for sig in _OUTLIVED:
        signal.signal(sig, signal.SIG_DFL)
    from plait.launch.job import worker_process  # lazily: the fork server imported it (PRELOAD); the launcher does not

    code = worker_process(Path(run_dir), resume)
    atexit._run_exitfuncs()  # a forked child's end runs no atexit handlers: the trackers' and the user's run here
    if code:
        sys.exit(code)


def stop() -> None:
    """End the fork server, if one runs (its children, the workers, have ended with the launch)."""
    server = forkserver._forkserver  # the stdlib's one fork server per process, which torch's agent forks from
    with server._lock:
        pid = server._forkserver_pid
        if pid is None:
            return
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)  # it only waits for fork requests: nothing of it is left to finish
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        with contextlib.suppress(OSError, TypeError, ValueError):  # ValueError: an abstract socket's name
            os.unlink(server._forkserver_address)
        server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
