"""The typed seam between the service (the front end) and the executors that run the model.

The service cuts batches and hands each executor one task; the executor answers with one result.
Tasks and results are small dataclasses, so each executor dispatches with one `match` on the
task's type, and the same objects cross a pipe to a replica process unchanged (they pickle):

    Infer(inputs)            -> InferOutput(outputs)     rows of one input, stacked; {output name: array}
    Generate(rows)           -> GenerateOutput(tokens)   one GenRow per request; new token ids (or RowFailed) per row

Streaming and cancellation are not part of a task (callbacks do not cross processes): `run` takes
`on_event(row, position, token)` and `cancelled(row)` beside it, and a replica pool turns them into
the pipe messages below. Every executor satisfies `Executor`.

Replica pipe messages (plait.serve.fleet.replicas <-> plait.serve.fleet.replica_worker):

    server -> replica   Submit(task_id, task), Cancel(task_id, rows), None (stop after the tasks it has)
    replica -> server   Ready(pid, cold_start), LoadFailed(traceback), Token(task_id, row, position, token),
                        Done(task_id, result), Failed(task_id, message)

Nothing here imports torch: a replica's cold start is measured from its first line (plait.serve.fleet.coldstart).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

Emit = Callable[[int, int, int], None]  # (row, position, token)
Cancelled = Callable[[int], bool]  # row -> whether its request was given up


@dataclass
class GenRow:
    """One generation request: prompt token ids and how to sample its continuation."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0  # <= 0: greedy
    top_k: int | None = None
    seed: int = 0


@dataclass
class RowFailed:
    """In place of a row's tokens: why that row (alone) could not be generated."""

    message: str


# ------------------------------------------------------------------ tasks


@dataclass(frozen=True, eq=False)  # eq=False: comparing arrays elementwise has no single truth value
class Infer:
    """A forward pass over `inputs` (the rows of every request in the batch, stacked on the first axis)."""

    inputs: np.ndarray
    kind: ClassVar[str] = "infer"  # what ReplicaPool.running() reports

    @staticmethod
    def merge(parts: Sequence[Infer]) -> Infer:
        """One task for the requests of a batch (same dtype and row shape: the batcher's key)."""
        if len(parts) == 1:
            return parts[0]
        return Infer(np.concatenate([p.inputs for p in parts]))


@dataclass(frozen=True)
class Generate:
    """New tokens for each row (one row per request: answers are split back by position)."""

    rows: tuple[GenRow, ...]
    kind: ClassVar[str] = "generate"

    @staticmethod
    def merge(parts: Sequence[Generate]) -> Generate:
        if len(parts) == 1:
            return parts[0]
        return Generate(tuple(row for p in parts for row in p.rows))


Task = Infer | Generate


# ------------------------------------------------------------------ results


@dataclass(frozen=True, eq=False)
class InferOutput:
    outputs: dict[str, np.ndarray]  # output name -> array with the task's rows


@dataclass(frozen=True)
class GenerateOutput:
    tokens: list[list[int] | RowFailed]  # per row, in the task's order


Result = InferOutput | GenerateOutput


@runtime_checkable
class Executor(Protocol):
    """What the service needs of whatever holds the model: in-process (runner.LocalExecutor), replica processes
    (replicas.ReplicaPool) or pipeline stages (pipeline.PipelineExecutor)."""

    capacity: int  # batches that may run at once
    restarts: int  # processes restarted after a crash

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def ready(self) -> bool: ...

    async def run(self, task: Task, on_event: Emit | None = None, cancelled: Cancelled | None = None) -> Result: ...


# ------------------------------------------------------------------ replica pipe messages


@dataclass(frozen=True)
class Submit:
    task_id: int
    task: Task


@dataclass(frozen=True)
class Cancel:
    task_id: int
    rows: tuple[int, ...]  # rows whose requests were given up


@dataclass(frozen=True)
class Ready:
    pid: int
    cold_start: dict | None  # {"process_s", "imports_s", "load_s"} when the replica measured it


@dataclass(frozen=True)
class LoadFailed:
    traceback: str


@dataclass(frozen=True)
class Token:
    task_id: int
    row: int
    position: int
    token: int


@dataclass(frozen=True, eq=False)
class Done:
    task_id: int
    result: Result


@dataclass(frozen=True)
class Failed:
    task_id: int
    message: str  # "ExceptionType: message"
