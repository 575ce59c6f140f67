"""One sequence of the continuous-batching engine as a task: the same `run(Complete, on_event)` whether the engine
is in this process (`EngineSequences`) or in a replica (plait.serve.fleet.replicas.ReplicaPool).

The service (plait.serve.service.Service.complete) starts `run` as an asyncio task and cancels that task to drop
the sequence (the client left, a stop string came, --timeout-ms passed): here the engine's handle is cancelled, a
replica pool sends Cancel to the replica. Tokens reach `on_event` on the event loop; the end is a CompleteOutput.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass

from plait.serve.engine.core import Engine, TokenEvent
from plait.serve.executor.tasks import Complete, CompleteOutput


@dataclass
class Completion:
    """What the engine generated for one sequence: its token events, why it ended, the prompt's token count."""

    events: list[TokenEvent]
    finish_reason: str  # "stop" (a stop token or string), "length" (max_tokens) or "abort"
    prompt_tokens: int


class Mailbox:
    """Calls from the engine's thread run on the event loop in the order posted, all that wait at one wake-up.

    One `call_soon_threadsafe` per token wrote to the loop's self-pipe and woke the loop once per token: 128
    streams were 128 syscalls and wake-ups per engine step, taken from the engine's share of the interpreter
    lock. Here a step's tokens are one wake-up: a post finding calls already waiting adds its own to them."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._calls: list[tuple[Callable, tuple]] = []

    def post(self, fn: Callable, *args) -> None:
        with self._lock:
            self._calls.append((fn, args))
            if len(self._calls) > 1:
                return  # a wake-up is on its way and runs this one too
        self.loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, args in calls:
            try:
                fn(*args)
            except Exception as e:  # as the loop does for a callback that raises: reported, the others still run
                self.loop.call_exception_handler({"message": f"exception in {fn!r}", "exception": e})


class EngineSequences:
    """This process's engine behind the task seam: `run(Complete, on_event)`."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._mailbox: Mailbox | None = None

    async def run(self, task: Complete, on_event: Callable[[TokenEvent], None]) -> CompleteOutput:
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = Mailbox(loop)
        post = self._mailbox.post
        ended: asyncio.Future = loop.create_future()

        def end(out: CompleteOutput) -> None:  # on the loop
            if not ended.done():
                ended.set_result(out)

        def on_done(reason: str) -> None:  # on the engine's thread
            e = self.engine.error
            post(end, CompleteOutput(reason, f"{type(e).__name__}: {e}" if reason == "error" else ""))

        try:
            handle = self.engine.submit(list(task.prompt), task.params, lambda ev: post(on_event, ev), on_done,
                                        task.adapter)
        except ValueError as e:  # it could never run here (too long for the pool or the context, no such adapter)
            return CompleteOutput("invalid", str(e))
        try:
            return await ended
        except asyncio.CancelledError:
            handle.cancel()  # its blocks go back to the pool at the engine's next step
            raise


def settle(job: asyncio.Future, finished: asyncio.Future) -> None:
    """A sequence's task ended: (finish reason, why) into `finished`, or the task's exception (a replica died
    mid-stream, none could be reached). Nothing when it was cancelled (whoever cancelled it settled `finished`)."""
    if job.cancelled():
        return
    error = job.exception()
    if finished.done():
        return
    if error is not None:
        finished.set_exception(error)
    else:
        out = job.result()
        finished.set_result((out.finish_reason, out.message))


def picklable(obj: object) -> bool:
    """Whether `obj` can cross a pipe to a replica (a grammar factory of structured output may not)."""
    try:
        pickle.dumps(obj)
    except Exception:  # pickle raises more than PicklingError (TypeError, AttributeError) for what it cannot take
        return False
    return True
