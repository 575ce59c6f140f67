"""`--replicas N`: N worker processes each holding the whole model; the router sends a batch to the least-loaded one.

Each replica is a spawned process that loads the weights itself (from the same `ModelRef`) and
answers tasks over a pipe, one at a time, with the code the in-process executor runs
(plait.serve.executor.runner). A reader thread per replica turns its messages into results on the
event loop; end-of-file on the pipe means the process died. Then its in-flight batches go
to another replica (each batch is tried at most twice), a replacement process is started,
and a batch that fails twice gets a 503 that says so: a crash never leaves a request hanging.

The pipe carries the typed messages of plait.serve.executor.tasks (Submit, Cancel; Ready, LoadFailed,
Token, Done, Failed); the replica's side is plait.serve.fleet.replica_worker, reached through
plait.serve.fleet.coldstart (which times the replica's imports).

Cancellation reaches the process: while a generation batch runs, the pool watches which of its
requests were given up (the client disconnected, or --timeout-ms passed) and sends
Cancel(task, rows); a thread in the replica reads those while the model runs, and the
generation loop drops the rows at its next token (plait.serve.executor.generate).

--device cuda: each replica loads the weights on the host and its runner moves them to GPU
`index mod GPUs` (plait.serve.model.device); replicas on one GPU share it, each with its own copy.

A language model's replicas run the continuous-batching engine (`engine`: EngineOptions.to_dict()): each sequence
of the OpenAI endpoints is a Complete task of its own, sent at once (no batcher: each engine batches every step) to
the replica the router picks (plait.serve.fleet.router: the longest cached prefix, else the least loaded). Its
TokenEvents stream back as Token messages; cancelling the `run` that awaits it sends Cancel to the replica. A
replica that dies takes its sequences' streams with it: one that had streamed nothing yet goes to another replica,
the others end with a 503. Each replica reports its engine's counters (Stats) after every sequence; `engine_totals`
adds them up for /metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client import Gauge

from plait.procs import CONTEXT, spawn
from plait.serve.errors import RequestError, ServeError
from plait.serve.executor.tasks import (
    Cancel,
    Cancelled,
    Complete,
    Done,
    Emit,
    Failed,
    Generate,
    LoadFailed,
    Ready,
    Result,
    Stats,
    Submit,
    Task,
    Token,
)
from plait.serve.fleet.coldstart import replica_entry
from plait.serve.fleet.router import PrefixRouter
from plait.serve.model.load import ModelRef

ATTEMPTS = 2  # a batch whose replica crashes is retried once
CANCEL_POLL_S = 0.05  # how often a running generation batch is checked for requests given up
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(eq=False)
class _Task:
    id: int
    task: Task
    future: asyncio.Future
    on_event: Emit | None = None
    attempts: int = 0
    replica: Any = None  # the replica running it now
    cancelled_rows: set = field(default_factory=set)  # rows given up (sent to whichever replica runs it)
    streamed: int = 0  # a Complete's tokens passed on (one that streamed some cannot start again elsewhere)


@dataclass(eq=False)
class _Replica:
    index: int
    proc: Any
    conn: Any
    live: bool = False
    was_live: bool = False  # a replica that never loaded is not restarted (it would fail again)
    retiring: bool = False  # told to stop by the autoscaler: finishes what it has, then exits (not restarted)
    inflight: dict[int, _Task] = field(default_factory=dict)
    started: asyncio.Future | None = None
    stats: dict = field(default_factory=dict)  # its engine's latest counters (a Stats message)


class ReplicaPool:
    """The executor for `--replicas N` and `--autoscale` (an `Executor`, plait.serve.executor.tasks)."""

    def __init__(self, ref: ModelRef, n: int, pad_to: int | None, restart_counter=None, threads: int = 1,
                 start_timeout_s: float = 180.0, device: str = "cpu", autoscale_min: int | None = None,
                 on_cold_start=None, engine: dict | None = None, route: str = "prefix"):
        """`autoscale_min`: autoscaling between it and n (the slots); replicas come and go by `scale_to`, and a
        batch waits in the pool until a replica is free (a replica that starts takes the waiting ones).
        `engine`: each replica runs the continuous-batching engine with these options (EngineOptions.to_dict()),
        and Complete tasks go to the replica `route` picks (plait.serve.fleet.router.ROUTES)."""
        if engine is not None and autoscale_min is not None:
            raise ServeError("replicas that run the engine are not autoscaled in this version of plait")
        self.ref, self.n, self.pad_to, self.threads, self.device = ref, n, pad_to, threads, device
        self.engine = engine
        self.router = PrefixRouter(engine["engine_config"]["block_size"], route) if engine is not None else None
        self.capacity = n
        self.autoscale = autoscale_min is not None
        self.target = n if autoscale_min is None else autoscale_min  # replicas wanted (running or starting)
        self.on_cold_start = on_cold_start  # (index, {"process_s", "imports_s", "load_s"})
        # called when a batch arrives and no replica is up (the autoscaler's wake-up)
        self.on_no_replica: Callable[[], None] | None = None
        self.cold_starts: list[tuple[int, dict]] = []
        self.restarts = 0
        self._counter = restart_counter
        self._timeout = start_timeout_s
        self._replicas: list[_Replica | None] = [None] * n
        self._waiting: list[_Task] = []
        self._ids = itertools.count()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._past = {"hit_tokens": 0, "query_tokens": 0, "generated": 0}  # replicas that died: their engines' counts

    # ------------------------------------------------------------------ processes

    def _spawn(self, index: int, first: bool = False) -> _Replica:
        parent, child = CONTEXT.Pipe()
        # OMP_NUM_THREADS is read by the child's OpenMP before torch is imported.
        args = (child, asdict(self.ref), self.pad_to, self.threads, self.device, index, time.time(), self.engine)
        proc = spawn(replica_entry, args, name=f"plait-replica-{index}", env=WORKER_ENV)
        child.close()  # so that the child's death is end-of-file here
        assert self._loop is not None
        r = _Replica(index, proc, parent, started=self._loop.create_future() if first else None)
        self._replicas[index] = r
        t = threading.Thread(target=self._read, args=(r,), name=f"plait-replica-{index}-reader", daemon=True)
        t.start()
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        return r

    def _read(self, r: _Replica) -> None:
        """Reader thread: forward every message to the loop; on end-of-file report the death."""
        assert self._loop is not None
        while True:
            try:
                msg = r.conn.recv()
            except (EOFError, OSError):
                break
            self._loop.call_soon_threadsafe(self._on_message, r, msg)
        r.proc.join(10)
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_death, r)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        started: list[asyncio.Future] = []
        for i in range(self.target):
            future = self._spawn(i, first=True).started
            assert future is not None, "_spawn(first=True) gives the replica its start-up future"
            started.append(future)
        try:
            await asyncio.wait_for(asyncio.gather(*started), self._timeout)
        except BaseException:
            await self.stop()
            raise

    def ready(self) -> bool:
        """Some replica can answer; under autoscaling always (a request is held while one starts)."""
        return self.autoscale or any(r is not None and r.live for r in self._replicas)

    @property
    def live_count(self) -> int:
        return sum(1 for r in self._replicas if r is not None and r.live and not r.retiring)

    @property
    def process_count(self) -> int:
        """Replica processes that exist (starting, running or finishing before they exit)."""
        return sum(1 for r in self._replicas if r is not None)

    def scale_to(self, k: int) -> None:
        """Start or retire replicas until k are running or starting (idempotent; at most n processes ever)."""
        assert self._loop is not None and self.autoscale
        self.target = k = max(0, min(k, self.n))
        if self._stopping:
            return
        active = [r for r in self._replicas if r is not None and not r.retiring]
        for index in [i for i, r in enumerate(self._replicas) if r is None][:max(0, k - len(active))]:
            self._spawn(index)
        if len(active) > k:  # retire starting ones first, then the idlest, highest index first
            order = sorted(active, key=lambda r: (r.live, len(r.inflight), -r.index))
            for r in order[:len(active) - k]:
                r.retiring = True
                try:
                    r.conn.send(None)  # after the tasks it already has
                except (OSError, ValueError):
                    pass

    def pids(self) -> list[int | None]:
        """Process ids of the replicas that are up (None where one is starting)."""
        return [r.proc.pid if r is not None and r.live else None for r in self._replicas]

    def running(self) -> list[list[tuple[str, int]]]:
        """Per replica: (task kind, attempt) of each batch it is running (what operators and tests look at)."""
        return [[(t.task.kind, t.attempts) for t in list(r.inflight.values())] if r is not None else []
                for r in self._replicas]

    def engine_stats(self) -> list[dict]:
        """Per replica slot: its engine's latest counters ({} where none came yet, or the replica died)."""
        return [dict(r.stats) if r is not None else {} for r in self._replicas]

    def engine_totals(self) -> dict:
        """The replicas' engines added up: sequences, blocks, generated tokens, and the prefix cache's hit rate over
        every replica's lookups (prompt tokens found / looked up; a dead replica's lookups still count)."""
        stats = [r.stats for r in self._replicas if r is not None and r.stats]
        total = {k: sum(s.get(k, 0) for s in stats) for k in ("running", "waiting", "preemptions", "blocks_used",
                                                               "blocks", "hit_tokens", "query_tokens", "generated")}
        for key, value in self._past.items():
            total[key] += value
        total["prefix_hit_rate"] = total["hit_tokens"] / total["query_tokens"] if total["query_tokens"] else 0.0
        return total

    def watch_engines(self, registry) -> None:
        """The engine gauges of /metrics (plait.serve.metrics.Metrics.watch_engine's names), over every replica."""
        for name, doc, key in (
                ("plait_sequences_running", "sequences in the replicas' engines' batches", "running"),
                ("plait_sequences_waiting", "sequences waiting for a replica engine's batch", "waiting"),
                ("plait_sequences_preempted", "preemptions so far, all replicas", "preemptions"),
                ("plait_kv_blocks_used", "KV-cache blocks held by sequences, all replicas", "blocks_used"),
                ("plait_prefix_cache_hit_rate", "prompt tokens found in the prefix caches / prompt tokens looked up, "
                 "all replicas", "prefix_hit_rate")):
            Gauge(name, doc, registry=registry).set_function(lambda key=key: self.engine_totals()[key])

    async def stop(self) -> None:
        self._stopping = True
        for r in self._replicas:
            if r is not None:
                if not r.live:  # still loading (it holds no work): no need to wait for its cold start to end
                    r.proc.kill()
                try:
                    r.conn.send(None)
                except (OSError, ValueError):
                    pass
        loop = asyncio.get_running_loop()
        for r in self._replicas:
            if r is not None:
                await loop.run_in_executor(None, r.proc.join, 10)
                if r.proc.is_alive():
                    r.proc.kill()
                    await loop.run_in_executor(None, r.proc.join, 10)
        for thread in self._threads:
            await loop.run_in_executor(None, thread.join, 10)
        for r in self._replicas:
            if r is not None:
                r.conn.close()
        for t in self._waiting:
            if not t.future.done():
                t.future.set_exception(RequestError(503, "the server is shutting down"))

    # ------------------------------------------------------------------ routing

    async def run(self, task: Task, on_event: Emit | None = None, cancelled: Cancelled | None = None) -> Result:
        assert self._loop is not None
        t = _Task(next(self._ids), task, self._loop.create_future(), on_event)
        self._dispatch(t)
        try:
            match task:
                case Generate(rows=rows) if cancelled is not None:  # a generation's requests may be given up as it runs
                    watcher = self._loop.create_task(self._watch(t, cancelled, len(rows)))
                    try:
                        return await t.future
                    finally:
                        watcher.cancel()
                case _:
                    return await t.future
        except asyncio.CancelledError:  # given up (every request of the batch): if it still waits, it is never sent
            if t in self._waiting:
                self._waiting.remove(t)
            elif isinstance(task, Complete):  # the client left (or a stop string came): the engine drops the sequence
                self._send_cancel(t, {0})
            raise

    async def _watch(self, t: _Task, cancelled: Cancelled, rows: int) -> None:
        """Tell the replica running `t` about rows whose requests were given up (timeout, disconnect)."""
        while not t.future.done():
            new = {i for i in range(rows) if i not in t.cancelled_rows and cancelled(i)}
            if new:
                t.cancelled_rows |= new
                self._send_cancel(t, new)
            await asyncio.sleep(CANCEL_POLL_S)

    def _send_cancel(self, t: _Task, rows: set) -> None:
        r = t.replica
        if r is not None and r.live and t.id in r.inflight:
            try:
                r.conn.send(Cancel(t.id, tuple(sorted(rows))))
            except (OSError, ValueError):
                pass  # the replica is dying; the reader thread re-routes its work

    def _dispatch(self, t: _Task) -> None:
        live = [r for r in self._replicas if r is not None and r.live and not r.retiring]
        if self.autoscale:
            live = [r for r in live if not r.inflight]  # wait in the pool for a free replica (a new one takes it)
        if not live:
            self._waiting.append(t)  # a replacement is starting; the request's own timeout bounds the wait
            if self.autoscale and self.live_count == 0 and self.on_no_replica is not None:
                self.on_no_replica()
            return
        if isinstance(t.task, Complete) and self.router is not None:
            route = self.router.choose(t.task.prompt, t.task.adapter or None, {x.index: len(x.inflight) for x in live})
            r = next(x for x in live if x.index == route.replica)
        else:
            r = min(live, key=lambda r: (len(r.inflight), r.index))  # least loaded
        t.attempts += 1
        t.replica = r
        r.inflight[t.id] = t
        try:
            r.conn.send(Submit(t.id, t.task))
        except (OSError, ValueError):
            pass  # the reader thread sees the death and re-routes what was in flight
        if t.cancelled_rows:  # a retried batch: the new replica hears what was given up
            self._send_cancel(t, t.cancelled_rows)

    def _on_message(self, r: _Replica, msg: Ready | LoadFailed | Token | Done | Failed | Stats) -> None:
        match msg:
            case Ready(pid=pid, cold_start=split):
                self._on_ready(r, pid, split)
            case LoadFailed(traceback=tb):
                self._on_load_failed(r, tb)
            case Token(task_id=task_id, row=row, position=pos, token=tok, event=event):
                t = r.inflight.get(task_id)
                if t is None or t.on_event is None or t.future.done():  # (a cancelled sequence's last tokens)
                    return
                if event is not None:  # a Complete's: the engine's TokenEvent
                    t.streamed += 1
                    t.on_event(event)
                else:
                    t.on_event(row, pos, tok)
            case Stats(engine=stats):
                r.stats = stats
                if self.router is not None:
                    self.router.set_capacity(r.index, stats["blocks"])
            case Done(task_id=task_id, result=result):
                self._settle(r, task_id, lambda f: f.set_result(result))
            case Failed(task_id=task_id, message=message):
                self._settle(r, task_id, lambda f: f.set_exception(RuntimeError(f"replica {r.index}: {message}")))

    def _settle(self, r: _Replica, task_id: int, settle: Callable[[asyncio.Future], None]) -> None:
        """A task `r` finished: answer its waiter (unless it gave up), then give `r` the next waiting batch."""
        t = r.inflight.pop(task_id, None)
        if t is not None and not t.future.done():
            settle(t.future)
        while self.autoscale and self._waiting and not r.retiring:  # the replica is free: the next waiting batch
            waiting = self._waiting.pop(0)
            if not waiting.future.done():  # (one given up is dropped)
                self._dispatch(waiting)
                break

    def _on_ready(self, r: _Replica, pid: int, split: dict | None) -> None:
        r.live = r.was_live = True
        if r.started is not None and not r.started.done():
            r.started.set_result(pid)
        if split is not None:
            self.cold_starts.append((r.index, split))
            if self.on_cold_start is not None:
                self.on_cold_start(r.index, split)
        waiting, self._waiting = self._waiting, []
        for t in waiting:
            if not t.future.done():
                self._dispatch(t)

    def _on_load_failed(self, r: _Replica, tb: str) -> None:
        error = ServeError(f"replica {r.index} could not load the model:\n{tb}")
        if r.started is not None and not r.started.done():
            r.started.set_exception(error)
        if not any(x is not None and x.live for x in self._replicas):
            waiting, self._waiting = self._waiting, []
            for t in waiting:
                if not t.future.done():
                    t.future.set_exception(RequestError(503, f"no replica is up: {str(error).splitlines()[0]}"))

    def _on_death(self, r: _Replica) -> None:
        r.live = False
        if self._stopping:
            return
        code = r.proc.exitcode
        lost, r.inflight = list(r.inflight.values()), {}
        if self.router is not None:  # its cache died with it
            self.router.forget(r.index)
        for key in self._past:  # its engine's prefix-cache counts stay in the totals
            self._past[key] += r.stats.get(key, 0)
        r.stats = {}
        if r.started is not None and not r.started.done():
            r.started.set_exception(ServeError(f"replica {r.index} exited with code {code} while loading the model"))
        if self.autoscale and (r.retiring or not r.was_live):  # its slot is free; the target may want it back
            if self._replicas[r.index] is r:
                self._replicas[r.index] = None
            r.conn.close()
            for t in lost:
                if not t.future.done():
                    self._dispatch(t)
            if not r.retiring:
                return  # a replica that never loaded would fail again: the autoscaler retries at its next change
            self.scale_to(self.target)
            return
        if not r.was_live:
            return
        if self._replicas[r.index] is r:
            self.restarts += 1
            if self._counter is not None:
                self._counter.inc()
            streams = sum(1 for t in lost if t.streamed)
            print(f"replica {r.index} (pid {r.proc.pid}) exited with code {code}; restarting it ({len(lost) - streams} "
                  f"request(s) in flight go to another replica" + (f", {streams} stream(s) end with an error" if streams
                                                                    else "") + ")", file=sys.stderr, flush=True)
            self._spawn(r.index)
        for t in lost:
            if t.future.done():
                continue
            if t.streamed:  # its client has tokens already: another replica would send them again
                t.future.set_exception(RequestError(
                    503, f"replica {r.index} (pid {r.proc.pid}) died with exit code {code} after streaming {t.streamed} "
                         f"token(s) of this sequence; it cannot go on elsewhere without repeating them: send it again"))
            elif t.attempts < ATTEMPTS:
                self._dispatch(t)
            else:
                t.future.set_exception(RequestError(
                    503, f"replica {r.index} (pid {r.proc.pid}) died with exit code {code} while running this request, "
                         f"after another replica had died running it too; nothing was answered, send it again"))
