"""Run a function on N gloo ranks: the harness plait's tests use, shipped for users' tests too.

    from plait.testing import run_distributed, RankPool

    def check(x):                       # module-level, so spawned processes can import it
        import torch.distributed as dist
        t = torch.tensor([x + dist.get_rank()])
        dist.all_reduce(t)
        return t.item()

    assert run_distributed(check, 2, 10) == [21, 21]    # one result per rank

    with RankPool(4) as pool:          # keep 4 ranks alive across many calls (fast test suites)
        pool.run(check, 1)

Ranks are spawned processes that meet through a FileStore in a temporary directory
(no ports to collide), with gloo pinned to loopback, OMP_NUM_THREADS=1 and a timeout
on every collective. An exception on any rank is raised in the caller with every
failing rank's traceback tagged by its rank; after a failure the pool restarts its
ranks, since a half-finished collective leaves the process group unusable.

Spawned ranks each import torch (and whatever the tasks use) afresh: a few seconds of CPU a rank. With
`warm=("plait.train.trainer", ...)` (or PLAIT_WARM_RANKS="mod,mod" in the environment) the ranks are forked instead
from a fork server of the pool's own process that imported torch, torch.distributed and those modules once; they
then run exactly as spawned ones do. The server is plait.testing's own, not the stdlib's one per process (which
plait's launcher and warm tune trials start and stop): a forked rank's exit status is read through its server.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import context as mp_context
from multiprocessing import forkserver, popen_forkserver, reduction, util
from multiprocessing import spawn as mp_spawn
from typing import Any

from plait.procs import CONTEXT, child_env, spawn

FAILURE_GRACE_S = 5.0  # how long the other ranks may take to finish once one has failed
RANK_ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MKL_NUM_THREADS": "1"}


class DistributedError(RuntimeError):
    """One or more ranks raised, died or timed out; the message holds each rank's traceback."""


def _exit_with_parent(parent: int) -> None:
    """A rank whose pool's process is gone (killed, or a test session interrupted) exits instead of waiting forever."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _rank_main(rank: int, world_size: int, store_path: str, timeout_s: float, tasks, results,
               env: dict[str, str] | None = None) -> None:
    if env is not None:  # forked from the warm server, with the pool's environment
        # a forkserver child keeps the server's "clients alive" pipe open (for forking children of its own): a rank
        # that did would keep the server, its parent, alive after the pool's process died, and so itself
        server: Any = forkserver._forkserver  # type: ignore[attr-defined]  # the stdlib's instance, in the child
        if server._forkserver_alive_fd is not None:
            os.close(server._forkserver_alive_fd)
            server._forkserver_alive_fd = None
        os.environ.update(env)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    os.environ.update(RANK_ENV)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            fn, args, kwargs = task
            try:
                results.put((rank, True, fn(*args, **kwargs)))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


_WARM_SERVERS: dict[tuple[str, ...], Any] = {}


def _warm_server(preload: tuple[str, ...]):
    """A fork server of this process's own (multiprocessing.forkserver.ForkServer, a second instance beside the stdlib's
    one) that imported torch, torch.distributed and `preload`; started with the first rank."""
    if preload not in _WARM_SERVERS:
        from multiprocessing import forkserver

        server = forkserver.ForkServer()
        server.set_forkserver_preload(["torch", "torch.distributed", "plait.testing", *preload])
        _WARM_SERVERS[preload] = server
    return _WARM_SERVERS[preload]


class _WarmPopen(popen_forkserver.Popen):
    """popen_forkserver.Popen through the rank's warm server: its queues, exit code and kill work alike."""

    def _launch(self, process_obj) -> None:
        # the pool's stdout and stderr as they are now (a spawned rank's would be; pytest's capfd swaps fd 1 and 2),
        # not the server's, or the fds the process was given for its 0, 1 and 2, passed to the child with the queues'
        process_obj.std_fds = {std: self.duplicate_for_child(fd) for std, fd in (process_obj.std or {1: 1, 2: 2}).items()}
        prep, buf = mp_spawn.get_preparation_data(process_obj._name), io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            reduction.dump(prep, buf)
            reduction.dump(process_obj, buf)
        finally:
            mp_context.set_spawning_popen(None)
        with child_env(RANK_ENV):  # the server, started by the first rank, imports torch with them
            self.sentinel, w = _warm_server(process_obj.warm).connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        parent_w = os.dup(w)
        close_fds = util.close_fds  # type: ignore[attr-defined]
        self.finalizer = util.Finalize(self, close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _WarmProcess(mp_context.ForkServerProcess):
    def __init__(self, warm: tuple[str, ...], std: dict[int, int] | None = None, **kwargs):
        """std: the child's standard fds (0, 1, 2) -> this process's fds they are copies of (default: {1: 1, 2: 2})."""
        super().__init__(**kwargs)
        self.warm = warm
        self.std = std
        self.std_fds: dict[int, int] | None = None  # set by _WarmPopen: each standard fd's place among those passed

    @staticmethod
    def _Popen(process_obj):
        return _WarmPopen(process_obj)

    def run(self) -> None:  # in the child: its standard fds first
        fds = forkserver.get_inherited_fds()
        if fds is not None and self.std_fds is not None:
            for std, i in self.std_fds.items():
                os.dup2(fds[i], std)
        super().run()


def _warm_default() -> tuple[str, ...] | None:
    got = os.environ.get("PLAIT_WARM_RANKS")
    return None if got is None else tuple(m for m in got.split(",") if m)


class RankPool:
    """`world_size` live ranks that run functions on request (see the module docstring)."""

    def __init__(self, world_size: int, timeout_s: float = 120.0, recycle_after: int = 0,
                 warm: tuple[str, ...] | None = None):
        """recycle_after: recycle_if_due starts fresh ranks after this many tasks (0: never). Every process group a task makes (a
        device mesh's axes, a pipeline's pairs) stays registered with torch for the process's life, each with gloo
        threads of its own, some of them polling: ranks that run hundreds of tasks carry a thousand such threads and
        slow the whole machine. Destroying the groups after each task is not enough, as DTensor's caches keep meshes
        (equal to the next task's) that name them."""
        if not 1 <= world_size <= 8:
            raise ValueError(f"world_size = {world_size}: the harness runs 1 to 8 ranks")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.warm = _warm_default() if warm is None else tuple(warm)  # None: spawned ranks
        self.recycle_after = recycle_after
        self._runs = 0
        self.tasks_run = 0  # every task this pool ran, across restarts
        self._procs: list = []
        self._dir: str | None = None

    def _start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="plait-ranks-")
        self._results = CONTEXT.Queue()
        self._tasks = [CONTEXT.Queue() for _ in range(self.world_size)]
        self._procs = []
        try:
            for r in range(self.world_size):
                args = (r, self.world_size, os.path.join(self._dir, "store"), self.timeout_s, self._tasks[r], self._results)
                if self.warm is None:
                    self._procs.append(spawn(_rank_main, args, env=RANK_ENV))
                else:
                    proc = _WarmProcess(self.warm, target=_rank_main, args=(*args, dict(os.environ)), daemon=True)
                    proc.start()
                    self._procs.append(proc)
        except BaseException:
            self.close(graceful=False)
            raise

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list:
        """Run fn(*args, **kwargs) on every rank; returns the results in rank order."""
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + self.timeout_s * 2 + 60  # the first call also spawns and imports torch
        while len(got) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=0.5)
                got[rank] = (ok, value)
                if not ok:  # the others are likely stuck in a collective with the failed rank
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
            if dead and len(got) + len(dead) < self.world_size and time.monotonic() <= deadline:
                # the living ranks may be about to say why (a lost peer is an error of their own): wait for them
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                dead = []
            if dead or time.monotonic() > deadline:
                errors = {r: f"process exited with code {self._procs[r].exitcode}" for r in dead}
                for r in range(self.world_size):
                    if r not in got and r not in errors:
                        errors[r] = "did not finish (hung in a collective, or waiting for a failed rank?)"
                for r, (ok, value) in got.items():
                    if not ok:
                        errors[r] = value
                self.close(graceful=False)
                raise DistributedError(_format(fn, errors))
        failed = {r: v for r, (ok, v) in got.items() if not ok}
        if failed:
            self.close(graceful=False)
            raise DistributedError(_format(fn, failed))
        self._runs += 1
        self.tasks_run += 1
        return [got[r][1] for r in range(self.world_size)]

    @property
    def started(self) -> bool:
        """Whether ranks are running (a pool starts them at its first task, and again after a close)."""
        return bool(self._procs)

    def recycle_if_due(self) -> None:
        """Fresh ranks from the next task on, once recycle_after tasks have run; call it where no task depends on
        what an earlier one left in the ranks (between tests: a test may register a module in them first)."""
        if self.recycle_after and self._runs >= self.recycle_after:
            self.close()

    def close(self, graceful: bool = True) -> None:
        """Stop the ranks: politely when idle, at once after a failure (they may be stuck)."""
        for p, q in zip(self._procs, getattr(self, "_tasks", [])):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=5 if graceful else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
        self._runs = 0
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _format(fn: Callable, errors: dict[int, str]) -> str:
    name = getattr(fn, "__qualname__", repr(fn))
    parts = [f"{name} failed on rank(s) {sorted(errors)}:"]
    for r in sorted(errors):
        body = "\n".join(f"[rank {r}] {line}" for line in str(errors[r]).rstrip().splitlines())
        parts.append(body)
    return "\n".join(parts)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0, **kwargs: Any) -> list:
    """Run fn on `world_size` fresh gloo ranks and return each rank's result, in rank order."""
    with RankPool(world_size, timeout_s) as pool:
        return pool.run(fn, *args, **kwargs)
