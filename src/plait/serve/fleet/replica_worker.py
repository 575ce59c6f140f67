"""Inside a replica process: load the model, then run the tasks that come down the pipe (plait.serve.fleet.replicas).

plait.serve.fleet.coldstart imports this module once the replica's clock runs; the pool in the server
imports only coldstart, so the two sides of the pipe share no module but plait.serve.executor.tasks, where
the messages are (server -> replica: Submit, Cancel, None to stop; replica -> server: Ready,
LoadFailed, Token, Done, Failed).

A thread reads the pipe while the model runs, so that a Cancel for the running generation
reaches it: the generation loop drops the cancelled rows at its next token (plait.serve.executor.generate).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback

import torch

from plait.serve.executor.runner import Runner
from plait.serve.executor.tasks import Cancel, Done, Failed, LoadFailed, Ready, Submit, Token
from plait.serve.model.device import torch_device
from plait.serve.model.load import ModelRef, load_model

MAX_STALE_CANCELS = 1024  # cancellations kept for tasks that had finished when they came


def replica_main(conn, ref: ModelRef, pad_to: int | None, threads: int, device: str = "cpu", index: int = 0,
                 timing: dict | None = None) -> None:
    """A replica process: load the model, then run tasks from the pipe until told to stop or the server goes away.

    `timing` (from plait.serve.fleet.coldstart): the cold start so far; the Ready message adds the load time."""
    torch.set_num_threads(threads)
    try:
        runner = Runner(load_model(ref), pad_to, torch_device(device, index))
        runner.prepare()
        split = None
        if timing is not None:
            split = {"process_s": timing["process_s"], "imports_s": timing["imports_s"],
                     "load_s": time.time() - timing["loaded_since"]}
        conn.send(Ready(os.getpid(), split))
    except BaseException:
        conn.send(LoadFailed(traceback.format_exc()))
        return
    _serve(conn, runner)


class _Inbox:
    """The pipe, read on a thread: tasks queue up in order, cancellations are recorded at once."""

    def __init__(self, conn):
        self.conn = conn
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


def _serve(conn, runner: Runner) -> None:
    inbox = _Inbox(conn)
    while (msg := inbox.tasks.get()) is not None:
        task_id = msg.task_id

        def emit(row: int, pos: int, tok: int, task_id=task_id) -> None:
            conn.send(Token(task_id, row, pos, tok))

        def given_up(row: int, task_id=task_id) -> bool:
            return inbox.given_up(task_id, row)

        try:
            result = runner.run(msg.task, emit, given_up)
        except Exception as e:
            conn.send(Failed(task_id, f"{type(e).__name__}: {e}"))
        else:
            conn.send(Done(task_id, result))
        inbox.finished(task_id)
