"""Inside a replica process: load the model, then run the tasks that come down the pipe (plait.serve.fleet.replicas).

plait.serve.fleet.coldstart imports this module once the replica's clock runs; the pool in the server
imports only coldstart, so the two sides of the pipe share no module but plait.serve.executor.tasks, where
the messages are (server -> replica: Submit, Cancel, None to stop; replica -> server: Ready,
LoadFailed, Token, Done, Failed).

A thread reads the pipe while the model runs, so that a Cancel for the running generation
reaches it: the generation loop drops the cancelled rows at its next token (plait.serve.executor.generate).

A language model's replica also runs the continuous-batching engine (plait.serve.engine.core), built as the
server's own is (plait.serve.engine.build). A Complete task goes to it straight from the pipe's reader thread (it
batches every step itself, so nothing waits behind a running batch); its tokens go back as Token messages from the
engine's thread, its end as Done(CompleteOutput) after a Stats message with the engine's counters, and a Cancel for
it cancels the sequence in the engine, whose blocks go back to the pool at its next step.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback

import torch

from plait.data.hf_tokenizer import HFTokenizer
from plait.serve.engine.build import EngineOptions, build_engine
from plait.serve.engine.core import Engine, Handle, TokenEvent, on_passing_thread
from plait.serve.engine.grammar import Grammars
from plait.serve.executor.runner import Runner
from plait.serve.executor.tasks import (
    Cancel,
    Complete,
    CompleteOutput,
    Done,
    Failed,
    LoadFailed,
    Ready,
    Stats,
    Submit,
    Token,
)
from plait.serve.model.device import torch_device
from plait.serve.model.load import ModelRef, freeze_loaded, load_model

MAX_STALE_CANCELS = 1024  # cancellations kept for tasks that had finished when they came
DRAIN_S = 5.0  # told to stop, a replica lets the sequences in its engine finish for at most this long


def replica_main(conn, ref: ModelRef, pad_to: int | None, threads: int, device: str = "cpu", index: int = 0,
                 timing: dict | None = None, engine: dict | None = None) -> None:
    """A replica process: load the model, then run tasks from the pipe until told to stop or the server goes away.

    `timing` (from plait.serve.fleet.coldstart): the cold start so far; the Ready message adds the load time.
    `engine`: EngineOptions.to_dict() when the replica runs the continuous-batching engine (Complete tasks)."""
    torch.set_num_threads(threads)
    out = _Outbox(conn)
    try:
        # loaded and built on a passing thread, which leaves no OpenMP team beside the engine's (on_passing_thread)
        served, runner, built = on_passing_thread(_load, ref, pad_to, device, index, engine)
        sequences = None
        if built is not None:
            sequences = _Sequences(built, out)
            if isinstance(served.tokenizer, HFTokenizer):  # structured output's GrammarRefs find this model's grammars
                Grammars.of_model(served.tokenizer.to_json(), served.vocab_size, served.eos_ids)
        split = None
        if timing is not None:
            split = {"process_s": timing["process_s"], "imports_s": timing["imports_s"],
                     "load_s": time.time() - timing["loaded_since"]}
        freeze_loaded()  # the loaded heap, out of the collector's full passes (a 230 ms pause stalled every stream)
        if sequences is not None:
            sequences.engine.start()
            out.send(Stats(sequences.stats()))
        out.send(Ready(os.getpid(), split))
    except BaseException:
        out.send(LoadFailed(traceback.format_exc()))
        return
    _serve(out, runner, sequences)


def _load(ref, pad_to, device, index, engine):
    served = load_model(ref)
    runner = Runner(served, pad_to, torch_device(device, index))
    runner.prepare()
    built = None
    if engine is not None:
        built, _, _ = build_engine(served, ref, EngineOptions.from_dict(engine), runner.device)
    return served, runner, built


class _Outbox:
    """The pipe's sending end, shared by the main thread, the reader thread and the engine's thread."""

    def __init__(self, conn):
        self.conn, self.lock = conn, threading.Lock()

    def send(self, msg) -> None:
        with self.lock:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):
                pass  # the server is gone: the reader sees end-of-file and the replica stops


class _Sequences:
    """The replica's engine and the Complete tasks it runs: task id -> the engine's handle."""

    def __init__(self, engine: Engine, out: _Outbox):
        self.engine, self.out = engine, out
        self.handles: dict[int, Handle] = {}
        self.finished: dict[str, int] = {}  # finish reason -> sequences
        self.lock = threading.Lock()

    def submit(self, task_id: int, task: Complete) -> None:
        def on_token(ev: TokenEvent) -> None:
            self.out.send(Token(task_id, 0, ev.index, ev.token, ev))

        def on_done(reason: str) -> None:
            kind = reason.partition(":")[0]  # "failed: why" counts as "failed"
            with self.lock:
                self.handles.pop(task_id, None)
                self.finished[kind] = self.finished.get(kind, 0) + 1
            e = self.engine.error
            self.out.send(Stats(self.stats()))
            self.out.send(Done(task_id, CompleteOutput(reason, f"{type(e).__name__}: {e}" if reason == "error" else "")))

        with self.lock:
            try:
                self.handles[task_id] = self.engine.submit(list(task.prompt), task.params, on_token, on_done,
                                                           task.adapter)
            except ValueError as e:  # the request could never run here (too long for the pool or the context)
                self.out.send(Done(task_id, CompleteOutput("invalid", str(e))))

    def cancel(self, task_id: int) -> bool:
        """Cancel a Complete task's sequence; False when `task_id` is no sequence of this engine."""
        with self.lock:
            handle = self.handles.get(task_id)
        if handle is not None:
            handle.cancel()
        return handle is not None

    def stats(self) -> dict:
        e, pool = self.engine, self.engine.pool
        with self.lock:
            finished = dict(self.finished)
        return {"running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
                "preemptions": e.scheduler.preemptions, "blocks_used": pool.used, "blocks": pool.num_blocks,
                "hit_tokens": pool.hit_tokens, "query_tokens": pool.query_tokens, "generated": e.generated,
                "finished": finished}

    def drain(self) -> None:
        """Let the sequences in flight end (for at most DRAIN_S), then stop the engine's thread."""
        deadline = time.monotonic() + DRAIN_S
        while self.handles and time.monotonic() < deadline:
            time.sleep(0.02)
        self.engine.stop()


class _Inbox:
    """The pipe, read on a thread: tasks queue up in order, cancellations are recorded at once; Complete tasks go to
    the engine at once, and so do their cancellations."""

    def __init__(self, conn, sequences: _Sequences | None = None):
        self.conn, self.sequences = conn, sequences
        self.tasks: queue.Queue[Submit | None] = queue.Queue()
        self.cancelled: dict[int, set[int]] = {}  # task id -> rows given up
        self.lock = threading.Lock()
        threading.Thread(target=self._read, name="plait-replica-inbox", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                msg = None  # the server is gone
            match msg:
                case Submit(task_id=task_id, task=Complete() as task) if self.sequences is not None:
                    self.sequences.submit(task_id, task)
                case Cancel(task_id=task_id) if self.sequences is not None and self.sequences.cancel(task_id):
                    pass
                case Cancel(task_id=task_id, rows=rows):
                    with self.lock:
                        self.cancelled.setdefault(task_id, set()).update(rows)
                case Submit():
                    self.tasks.put(msg)
                case _:  # None: stop once the tasks already queued are done
                    self.tasks.put(None)
                    return

    def given_up(self, task_id: int, row: int) -> bool:
        with self.lock:
            return row in self.cancelled.get(task_id, ())

    def finished(self, task_id: int) -> None:
        with self.lock:
            self.cancelled.pop(task_id, None)
            if len(self.cancelled) > MAX_STALE_CANCELS:
                self.cancelled.clear()


def _serve(out: _Outbox, runner: Runner, sequences: _Sequences | None) -> None:
    inbox = _Inbox(out.conn, sequences)
    while (msg := inbox.tasks.get()) is not None:
        task_id = msg.task_id

        def emit(row: int, pos: int, tok: int, task_id=task_id) -> None:
            out.send(Token(task_id, row, pos, tok))

        def given_up(row: int, task_id=task_id) -> bool:
            return inbox.given_up(task_id, row)

        try:
            result = runner.run(msg.task, emit, given_up)
        except Exception as e:
            out.send(Failed(task_id, f"{type(e).__name__}: {e}"))
        else:
            out.send(Done(task_id, result))
        inbox.finished(task_id)
    if sequences is not None:
        sequences.drain()
