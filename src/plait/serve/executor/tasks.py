"""The typed seam between the service (the front end) and the executors that run the model.

The service cuts batches and hands each executor one task; the executor answers with one result.
Tasks and results are small dataclasses, so each executor dispatches with one `match` on the
task's type, and the same objects cross a pipe to a replica process unchanged (they pickle):

    Infer(inputs)            -> InferOutput(outputs)     rows of one input, stacked; {output name: array}
    Generate(rows)           -> GenerateOutput(tokens)   one GenRow per request; new token ids (or RowFailed) per row
    Complete(prompt, params) -> CompleteOutput(reason)   one sequence through a replica's engine (never batched here:
                                                         the engine batches every step)

Streaming and cancellation are not part of a task (callbacks do not cross processes): `run` takes
`on_event(row, position, token)` and `cancelled(row)` beside it, and a replica pool turns them into
the pipe messages below. A Complete's `on_event` takes the engine's TokenEvent instead, and it is cancelled by
cancelling the `run` that awaits it (the pool then sends Cancel(task_id, (0,))). Every executor satisfies `Executor`.

Replica pipe messages (plait.serve.fleet.replicas <-> plait.serve.fleet.replica_worker):

    server -> replica   Submit(task_id, task), Cancel(task_id, rows), None (stop after the tasks it has)
    replica -> server   Ready(pid, cold_start), LoadFailed(traceback), Token(task_id, row, position, token, event),
                        Done(task_id, result), Failed(task_id, message), Stats(engine)

Nothing here imports torch: a replica's cold start is measured from its first line (plait.serve.fleet.coldstart).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # torch comes with them; a replica unpickles these only after its imports are timed
    from plait.serve.engine.core import TokenEvent
    from plait.serve.engine.sampling import SamplingParams

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


@dataclass(frozen=True)
class Complete:
    """One sequence for a replica's continuous-batching engine (plait.serve.engine.core): its TokenEvents stream back
    as Token messages, its finish reason comes in a CompleteOutput. `params.grammar`, when set, must pickle."""

    prompt: tuple[int, ...]
    params: SamplingParams
    adapter: int = 0  # 0: the served model; i: the i-th --lora adapter
    kind: ClassVar[str] = "complete"


Task = Infer | Generate | Complete


# ------------------------------------------------------------------ results


@dataclass(frozen=True, eq=False)
class InferOutput:
    outputs: dict[str, np.ndarray]  # output name -> array with the task's rows


@dataclass(frozen=True)
class GenerateOutput:
    tokens: list[list[int] | RowFailed]  # per row, in the task's order


@dataclass(frozen=True)
class CompleteOutput:
    """How a Complete ended: the engine's reason ("stop", "length", "abort", "failed: why" for this sequence's
    sampling, "error" when the engine's step failed) or "invalid" (the engine refused it); `message` says why."""

    finish_reason: str
    message: str = ""


Result = InferOutput | GenerateOutput | CompleteOutput


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
    event: TokenEvent | None = None  # a Complete's: the engine's event (log-probabilities included)


@dataclass(frozen=True, eq=False)
class Done:
    task_id: int
    result: Result


@dataclass(frozen=True)
class Failed:
    task_id: int
    message: str  # "ExceptionType: message"


@dataclass(frozen=True)
class Stats:
    """A replica engine's counters, sent after each sequence it finishes (and once before Ready): what the router
    bounds its prefix memory by and what /metrics adds up over the replicas."""

    engine: dict  # running, waiting, preemptions, blocks_used, blocks, hit_tokens, query_tokens, generated, finished
