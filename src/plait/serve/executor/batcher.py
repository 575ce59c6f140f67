"""Dynamic batching: a small policy object that decides, and an asyncio queue that carries the decisions out.

Requests wait in a bounded queue. A batch is cut when the queue holds `max_batch_size` rows
of the oldest request's kind, or when the oldest request has waited `max_delay_ms`, whichever
comes first, and only when the executor has a free slot (so a busy executor lets the next
batch grow). A full queue refuses at once (the server answers 503 with Retry-After) instead
of growing without bound; a request whose caller gave up is dropped before it is run.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Decision:
    run: bool  # cut a batch now
    wait_s: float  # else: wait at most this long before asking again


@dataclass(frozen=True)
class BatchPolicy:
    """When to cut a batch, and how many requests may wait."""

    max_batch_size: int = 16
    max_delay_ms: float = 5.0
    max_queue: int = 256

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 (1 turns batching off), got {self.max_batch_size}")
        if self.max_delay_ms < 0:
            raise ValueError(f"max_delay_ms must be >= 0, got {self.max_delay_ms}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")

    def admit(self, queued: int) -> bool:
        """Whether one more request may join a queue that holds `queued` requests."""
        return queued < self.max_queue

    def decide(self, queued_rows: int, oldest_waited_s: float) -> Decision:
        """Cut when a full batch is waiting or the oldest request has waited max_delay_ms."""
        left = self.max_delay_ms / 1000 - oldest_waited_s
        if queued_rows >= self.max_batch_size or left <= 0:
            return Decision(True, 0.0)
        return Decision(False, left)


class QueueFull(Exception):
    """The queue holds max_queue requests: come back later."""


@dataclass(eq=False)
class Pending:
    """One queued request: `rows` rows of work of kind `key`, answered through `future`."""

    key: Hashable
    payload: Any
    rows: int
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)
    cancelled: bool = False  # the caller timed out or went away: drop the work
    on_event: Callable[..., None] | None = None  # the caller's listener for partial answers (streamed tokens)


class Batcher:
    """Queue requests and hand batches to `run_batch` (which must resolve every request's future)."""

    def __init__(self, policy: BatchPolicy, run_batch: Callable[[list[Pending]], Awaitable[None]], capacity: int = 1,
                 on_batch: Callable[[int], None] | None = None):
        self.policy = policy
        self._run_batch = run_batch
        self._capacity = capacity
        self._on_batch = on_batch
        self._queue: collections.deque[Pending] = collections.deque()
        self._changed = asyncio.Event()
        self._slots = asyncio.Semaphore(capacity)
        self._running: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None

    @property
    def depth(self) -> int:
        """Requests waiting (not yet in a batch)."""
        return len(self._queue)

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Finish what is queued and running, then stop."""
        while self._queue or self._running:
            self._changed.set()
            if self._running:
                await asyncio.wait(set(self._running))
            else:
                await asyncio.sleep(0.01)  # the loop is cutting the last batch
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)

    def submit(self, key: Hashable, payload: Any, rows: int, on_event: Callable[..., None] | None = None) -> Pending:
        """Queue one request; raises QueueFull when the policy refuses it."""
        if not self.policy.admit(len(self._queue)):
            self._purge()
            if not self.policy.admit(len(self._queue)):
                raise QueueFull(f"the queue holds {len(self._queue)} requests (max_queue = {self.policy.max_queue})")
        item = Pending(key, payload, rows, asyncio.get_running_loop().create_future(), on_event=on_event)
        self._queue.append(item)
        self._changed.set()
        return item

    def cancel(self, item: Pending) -> None:
        """The caller gave up: if the request is still queued it is dropped, never run."""
        item.cancelled = True
        if not item.future.done():
            item.future.cancel()
        self._changed.set()

    def _purge(self) -> None:
        if any(p.cancelled for p in self._queue):
            self._queue = collections.deque(p for p in self._queue if not p.cancelled)

    def _rows(self, key: Hashable) -> int:
        return sum(p.rows for p in self._queue if p.key == key and not p.cancelled)

    def _take(self, key: Hashable) -> list[Pending]:
        """Up to max_batch_size rows of kind `key`, oldest first; other kinds keep their places."""
        batch: list[Pending] = []
        rest: collections.deque[Pending] = collections.deque()
        rows = 0
        for p in self._queue:
            if p.cancelled:
                continue
            if p.key == key and (not batch or rows + p.rows <= self.policy.max_batch_size):
                batch.append(p)
                rows += p.rows
            else:
                rest.append(p)
        self._queue = rest
        return batch

    async def _loop(self) -> None:
        while True:
            self._purge()
            if not self._queue:
                self._changed.clear()
                await self._changed.wait()
                continue
            first = self._queue[0]
            decision = self.policy.decide(self._rows(first.key), time.monotonic() - first.arrived)
            if not decision.run:
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), decision.wait_s)
                except TimeoutError:
                    pass
                continue
            await self._slots.acquire()
            batch = self._take(first.key)
            if not batch:
                self._slots.release()
                continue
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[Pending]) -> None:
        try:
            if self._on_batch is not None:
                self._on_batch(sum(p.rows for p in batch))
            await self._run_batch(batch)
        except BaseException as e:  # every waiter hears about the failure; none hangs
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            if not isinstance(e, Exception):
                raise
        finally:
            self._slots.release()
            self._changed.set()
