"""`--pp K`: the model's blocks split over K processes (training's own split code), joined by torch.distributed.

Stage r holds `pipeline_stage(model, stage_bounds(model, K), r)` — the same cut as pipeline
training. The server puts micro-batches on stage 0's queue; each stage runs its part and
sends the activations to the next with point-to-point gloo messages (plait.comm.p2p: a header
with the message's tags, dtype and shape, then the data); the last stage returns results on a
queue. A stage works on micro-batch i+1 while the next one works on micro-batch i, so a batch
split into K micro-batches keeps every stage busy, and several batches may be in the pipeline at once.

Generation through a pipeline keeps a KV cache per row in every stage (the model's own cached
forward, each stage for its blocks): a row's prompt goes down once, then one token per step,
until the row outgrows the context and its window is recomputed each step, as in
plait.serve.executor.generate. The server drops a request's caches when it ends. Rows travel as separate
micro-batches, so they overlap in the stages.
A stage that dies fails the requests in flight with a 503 and the server reports not-ready.

--device cuda: each stage loads the model on the host, cuts out its part and moves only that to
GPU `rank mod GPUs` (plait.serve.model.device; stages on one GPU share it). Activations still travel
between stages through host memory: gloo sends CPU tensors, and NCCL cannot join two processes
that share a GPU. A stage moves what it receives to its device and what it sends back to the host.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import os
import queue
import shutil
import tempfile
import threading
import traceback
from dataclasses import dataclass

import numpy as np

from plait.comm.p2p import recv_message, send_tensor
from plait.parallel.split import pipeline_stage, stage_bounds
from plait.procs import CONTEXT, spawn
from plait.serve.errors import RequestError, ServeError
from plait.serve.executor.generate import sample_row
from plait.serve.executor.tasks import (
    Cancelled,
    Emit,
    Failed,
    Generate,
    GenerateOutput,
    GenRow,
    Infer,
    InferOutput,
    Result,
    RowFailed,
    Task,
)
from plait.serve.model.device import torch_device
from plait.serve.model.load import ModelRef, ServedModel, load_model

STAGE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
# A message's tags: (flag, task id, micro-batch, cache id); cache id -1: a plain forward without a cache.
DATA, STOP, SKIP, DROP = 0, 1, 2, 3
NO_CACHE = -1


@dataclass(frozen=True)
class StageReady:
    """A stage's status message: loaded, holding blocks `bounds` (a task's error is a tasks.Failed)."""

    rank: int
    pid: int
    bounds: tuple[int, int]  # [first, last) block


@dataclass(frozen=True)
class StageFailed:
    rank: int
    traceback: str


def stage_main(rank: int, world: int, store_path: str, ref: ModelRef, inbox, outbox, status, threads: int,
               device: str = "cpu") -> None:
    """One pipeline stage: receive, run its blocks, send on; until a STOP header comes down the pipeline."""
    import torch
    import torch.distributed as dist


    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
        dev = torch_device(device, rank)
        served = load_model(ref)
        bounds = stage_bounds(served.module, world)
        part = pipeline_stage(served.module, bounds, rank).eval().to(dev)  # the whole model stays on the host
        del served
        status.put(StageReady(rank, os.getpid(), bounds[rank]))
    except BaseException:
        status.put(StageFailed(rank, traceback.format_exc()))
        return
    pending: list = []
    caches: dict[int, dict] = {}  # generation rows' KV caches for this stage's blocks, until the server drops them

    def send(tags: tuple, t=None) -> None:
        for w in pending:  # at most one message in flight: its buffers must live until it is sent
            w.wait()
        pending[:] = send_tensor(t, rank + 1, tags=tags, async_op=True)

    last = rank == world - 1
    with torch.inference_mode():
        while True:
            if rank == 0:
                msg = inbox.get()
                (flag, task_id, mb, cid), x = ((STOP, 0, 0, NO_CACHE), None) if msg is None else msg
                x = None if x is None else torch.from_numpy(x)
            else:
                (flag, task_id, mb, cid), x = recv_message(rank - 1, "cpu")
            x = None if x is None else x.to(dev)  # ids (stage 0) or activations: from the host to this stage's device
            if flag == STOP:
                if not last:
                    send((STOP, 0, 0, NO_CACHE))
                break
            y = None
            if flag == DROP:
                caches.pop(cid, None)
            elif flag == DATA:
                try:
                    y = part(x) if cid == NO_CACHE else part(x, caches.setdefault(cid, {}))
                except Exception as e:
                    status.put(Failed(task_id, f"stage {rank}: {type(e).__name__}: {e}"))
                    flag = SKIP
            y = None if y is None else y.cpu()  # to the host: gloo sends CPU tensors, the server reads numpy
            if last:
                if flag == DATA:
                    outbox.put((task_id, mb, y.float().numpy()))
            else:
                send((flag, task_id, mb, cid), y)
    for w in pending:
        w.wait()
    dist.destroy_process_group()


class PipelineExecutor:
    """The executor for `--pp K` (an `Executor`, plait.serve.executor.tasks)."""

    restarts = 0

    def __init__(self, ref: ModelRef, served: ServedModel, stages: int, threads: int = 1, start_timeout_s: float = 180.0,
                 device: str = "cpu"):
        module = served.module
        if not hasattr(module, "pipeline_parts"):
            raise ServeError(f"--pp {stages}: a {served.registry_name} model cannot be cut into pipeline stages "
                             "(it has no pipeline_parts()); serve it with --replicas instead")
        n_blocks = len(getattr(module, module.pipeline_parts()["blocks"]))
        if not 1 <= stages <= n_blocks:
            raise ServeError(f"--pp {stages}: the model has {n_blocks} blocks; use --pp between 1 and {n_blocks}")
        self.ref, self.served, self.k, self.threads, self.device = ref, served, stages, threads, device
        self.capacity = stages
        self._timeout = start_timeout_s
        self._ids = itertools.count()
        self._cache_ids = itertools.count()
        self._tasks: dict[int, tuple[asyncio.Future, list]] = {}
        self._ready: set[int] = set()
        self._broken: str | None = None
        self._closing = False  # stop() has begun: stages exiting now are not failures
        self._stopping = False  # the reader threads may end
        self.bounds: list = [None] * stages
        self.pids: list[int | None] = [None] * stages

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._dir = tempfile.mkdtemp(prefix="plait-pp-")
        self._inbox, self._outbox, self._status = CONTEXT.Queue(), CONTEXT.Queue(), CONTEXT.Queue()
        self._procs = []
        for r in range(self.k):  # appended one by one: stop() ends those started before a failed start
            self._procs.append(spawn(stage_main, (r, self.k, os.path.join(self._dir, "store"), self.ref,
                                                  self._inbox if r == 0 else None, self._outbox if r == self.k - 1 else None,
                                                  self._status, self.threads, self.device), name=f"plait-stage-{r}",
                                     env=STAGE_ENV))
        self._started = self._loop.create_future()
        self._threads = [threading.Thread(target=fn, daemon=True, name=name)
                         for fn, name in ((self._read_status, "plait-pp-status"), (self._read_results, "plait-pp-results"))]
        for t in self._threads:
            t.start()
        try:
            await asyncio.wait_for(asyncio.shield(self._started), self._timeout)
        except BaseException:
            await self.stop()
            raise

    def ready(self) -> bool:
        return len(self._ready) == self.k and self._broken is None

    # ------------------------------------------------------------------ reader threads (report to the loop)

    def _read_status(self) -> None:
        while not self._stopping:
            try:
                msg = self._status.get(timeout=0.2)
            except queue.Empty:
                dead = [(r, p) for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead and not self._closing:
                    r, p = dead[0]
                    self._loop.call_soon_threadsafe(self._on_broken, f"pipeline stage {r} (pid {p.pid}) died with exit "
                                                                     f"code {p.exitcode}; the pipeline is down")
                    return
                continue
            self._loop.call_soon_threadsafe(self._on_status, msg)

    def _read_results(self) -> None:
        while not self._stopping:
            try:
                task_id, mb, y = self._outbox.get(timeout=0.2)
            except queue.Empty:
                continue
            self._loop.call_soon_threadsafe(self._on_result, task_id, mb, y)

    def _on_status(self, msg: StageReady | StageFailed | Failed) -> None:
        match msg:
            case StageReady(rank=rank, pid=pid, bounds=bounds):
                self._ready.add(rank)
                self.pids[rank], self.bounds[rank] = pid, bounds
                if len(self._ready) == self.k and not self._started.done():
                    self._started.set_result(True)
            case StageFailed(rank=rank, traceback=tb):
                self._on_broken(f"pipeline stage {rank} could not start:\n{tb}")
            case Failed(task_id=task_id, message=message):
                entry = self._tasks.pop(task_id, None)
                if entry is not None and not entry[0].done():
                    entry[0].set_exception(RuntimeError(message))

    def _on_broken(self, why: str) -> None:
        self._broken = why
        if not self._started.done():
            self._started.set_exception(ServeError(why))
        tasks, self._tasks = self._tasks, {}
        for fut, _ in tasks.values():
            if not fut.done():
                fut.set_exception(RequestError(503, why.splitlines()[0]))

    def _on_result(self, task_id: int, mb: int, y: np.ndarray) -> None:
        entry = self._tasks.get(task_id)
        if entry is None:
            return
        fut, parts = entry
        parts[mb] = y
        if all(p is not None for p in parts):
            del self._tasks[task_id]
            if not fut.done():
                fut.set_result(parts)

    # ------------------------------------------------------------------ work

    async def _through(self, chunks: list[np.ndarray], cache_ids: list[int] | None = None) -> list[np.ndarray]:
        """Send micro-batches into the pipeline (each through its cache, if given); their outputs, in order."""
        if self._broken:
            raise RequestError(503, self._broken.splitlines()[0])
        task_id = next(self._ids)
        fut = self._loop.create_future()
        self._tasks[task_id] = (fut, [None] * len(chunks))
        for mb, c in enumerate(chunks):
            cid = NO_CACHE if cache_ids is None else cache_ids[mb]
            self._inbox.put(((DATA, task_id, mb, cid), np.ascontiguousarray(c)))
        return await fut

    async def run(self, task: Task, on_event: Emit | None = None, cancelled: Cancelled | None = None) -> Result:
        match task:
            case Infer(inputs=x):
                chunks = np.array_split(x, min(self.k, len(x)))  # K micro-batches keep K stages busy
                return InferOutput({"logits": np.concatenate(await self._through(chunks))})
            case Generate(rows=rows):
                return GenerateOutput(await self._generate(rows, on_event, cancelled))
            case _:
                raise TypeError(f"not a serving task: {type(task).__name__} (see plait.serve.executor.tasks)")

    async def _generate(self, rows: tuple[GenRow, ...], on_event: Emit | None,
                        cancelled: Cancelled | None) -> list[list[int] | RowFailed]:
        import torch

        ctx = self.served.context
        seqs = [list(r.prompt) for r in rows]
        out: list[list[int]] = [[] for _ in rows]
        gens = [torch.Generator().manual_seed(int(r.seed)) for r in rows]
        cids = [next(self._cache_ids) for _ in rows]
        cached: set[int] = set()  # rows whose prompt is in their caches: from now on they send one token
        failed: dict[int, RowFailed] = {}  # rows whose sampling failed: answered alone, the others go on
        try:
            while True:
                active = [i for i, r in enumerate(rows)
                          if len(out[i]) < r.max_new_tokens and i not in failed and not (cancelled and cancelled(i))]
                if not active:
                    return [failed.get(i, o) for i, o in enumerate(out)]
                windows, keys = [], []
                for i in active:
                    if len(seqs[i]) <= ctx:
                        windows.append(seqs[i][-1:] if i in cached else seqs[i])
                        keys.append(cids[i])
                        cached.add(i)
                    else:  # positions have shifted: the cached keys are stale
                        windows.append(seqs[i][-ctx:])
                        keys.append(NO_CACHE)
                logits = await self._through([np.array([w], dtype=np.int64) for w in windows], keys)
                for i, y in zip(active, logits):
                    try:
                        tok = sample_row(torch.from_numpy(y[0, -1]), rows[i], gens[i])
                    except (RuntimeError, ValueError, OverflowError) as e:
                        failed[i] = RowFailed(f"{type(e).__name__}: {str(e).strip()[:200]}")
                        continue
                    out[i].append(tok)
                    seqs[i].append(tok)
                    if on_event is not None:
                        on_event(i, len(out[i]) - 1, tok)
        finally:
            if not self._closing and self._broken is None:  # a stopped or broken pipeline's queues are closed
                for i in cached:
                    self._inbox.put(((DROP, 0, 0, cids[i]), None))

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        self._closing = True
        if getattr(self, "_procs", None):
            if self._broken is None:  # a STOP header walks down a healthy pipeline; a broken one is killed
                self._inbox.put(None)
                for p in self._procs:
                    await loop.run_in_executor(None, p.join, 15)
            self._stopping = True
            for p in self._procs:
                if p.is_alive():
                    p.kill()
                    await loop.run_in_executor(None, p.join, 10)
            for t in self._threads:
                await loop.run_in_executor(None, t.join, 5)
            for q in (self._inbox, self._outbox, self._status):
                q.close()
                q.cancel_join_thread()
        self._stopping = True
        if getattr(self, "_dir", None):
            shutil.rmtree(self._dir, ignore_errors=True)
        for fut, _ in self._tasks.values():
            if not fut.done():
                fut.set_exception(RequestError(503, "the server is shutting down"))
