"""`plait serve --pp K` for a language model: the continuous-batching engine, the model's blocks over K processes.

The server process is rank 0 and K - 1 stage processes are the others, joined by torch.distributed over gloo (the
hidden states travel through host memory, as in plait.serve.fleet.pipeline; each stage moves them to its own
device). Rank r holds stage r of pipeline training's cut (plait.parallel.split: `stage_bounds` balances the blocks by
parameters, the embedding counted with the first and the head with the last; `pipeline_stage` keeps them): rank 0 the
embedding and the first blocks, the last rank the last blocks, the final norm and the head. Each keeps a paged KV
cache (plait.serve.engine.paged) of the same block ids for its own layers only. `--kv-cache-mb` bounds each
process's pool, as each --tp rank's: the stage with the most blocks sets how many KV blocks there are.

Rank 0 runs the engine (scheduler, sampling, HTTP). Its model is stage 0 with a forward hook that carries the hidden
states through the later stages (`PipelineGroup.through`), so the engine, and the runner of /v2 infer, see one model
from token ids to logits. The ranks talk over a gloo group of their own (a ProcessGroupGloo object the group holds:
no default process group in the server), point to point, one forward at a time under rank 0's lock: rank 0 runs
stage 0 and sends rank 1 a message; rank r receives it from r - 1, runs its blocks and sends the same kind of message
on; the last rank sends the logits back to rank 0. A message is a fixed int64 header (flag, the step's length, the
tensor's dtype code, rank and shape), then the step, then the tensor (hidden states, logits, or an error's text).
The step (`encode_step`, int64s, never pickled) is each chunk's first position, token count and block table (the
blocks its tokens reach), the block copies made since the last step (copy-on-write, which the engine reports through
`announce`) and the tokens whose logits are read; a plain forward (/v2 infer) sends none and uses no cache.

Steps do not overlap (a stage idles while the others work): correctness and the memory split first. A stage whose
forward fails sends its error (FAILED) instead of its output and the later ranks pass it on; rank 0 raises it, so the
engine ends that step's requests with the error and goes on. A stage process that dies closes its connections: the
sends and receives to it fail at once (gloo: "Connection closed by peer"), the later stages' too, and the step in
flight fails; from then on the group is `down` (it says which stage died) and every forward raises `PipelineDown`.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch
import torch.nn as nn

from plait.comm.p2p import DTYPES, MAX_DIMS
from plait.parallel.split import pipeline_stage, stage_bounds
from plait.procs import CONTEXT, spawn
from plait.serve.engine.core import EngineConfig
from plait.serve.engine.paged import PagedCache, bytes_per_block, kv_geometry
from plait.serve.errors import RequestError, ServeError
from plait.serve.model.device import torch_device
from plait.serve.model.load import ModelRef, load_model

STAGE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
TIMEOUT = datetime.timedelta(seconds=600)  # a stage that hangs (not dies) fails the step after this
DATA, FAILED, STOP = 0, 1, 2  # a message's flag: an output, a stage's error (its text, UTF-8), or the end
HEADER = 4 + MAX_DIMS  # flag, the step's int64s (0: none), the tensor's dtype code (-1: none), rank, shape


@dataclass(frozen=True)
class StageInfo:
    """What one stage process holds, as it reports it once ready."""

    rank: int
    pid: int
    bounds: tuple[int, int]  # its blocks, [first, last)
    parameters: int  # parameter elements of its part of the model
    layers: tuple[str, ...]  # the blocks its KV cache holds keys and values for
    cache_bytes: int  # its KV cache: every layer's key and value pools


class PipelineDown(RequestError):
    """A stage process died: no forward can run any more (503 until the server is restarted)."""

    def __init__(self, why: str):
        super().__init__(503, why)


# ---------------------------------------------------------------------- the wire


def encode_step(chunks: Sequence, copies: Sequence[tuple[int, int]], rows: Sequence[int] | None) -> torch.Tensor:
    """A step as int64s: chunks (start, count, table length, table...), copies (src, dst), rows (-1: every token)."""
    out = [len(chunks)]
    for table, start, count in chunks:
        out += [start, count, len(table), *table]
    out += [len(copies), *(b for pair in copies for b in pair)]
    out += [-1] if rows is None else [len(rows), *rows]
    return torch.tensor(out, dtype=torch.int64)


def decode_step(step: torch.Tensor) -> tuple[list[tuple[list[int], int, int]], list[tuple[int, int]], list[int] | None]:
    values, at = step.tolist(), 0

    def take(n: int) -> list[int]:
        nonlocal at
        at += n
        return values[at - n:at]

    chunks = []
    for _ in range(take(1)[0]):
        start, count, width = take(3)
        chunks.append((take(width), start, count))
    flat = take(2 * take(1)[0])
    copies = list(zip(flat[::2], flat[1::2]))
    n = take(1)[0]
    return chunks, copies, None if n < 0 else take(n)


def send(pg, dst: int, flag: int, step: torch.Tensor | None = None, t: torch.Tensor | None = None) -> None:
    """One message to rank dst of `pg`: the header, the step, the tensor (each sent once the peer takes it)."""
    dims = [] if t is None else list(t.shape)
    head = [flag, 0 if step is None else step.numel(), -1 if t is None else DTYPES.index(t.dtype), len(dims), *dims]
    parts = [torch.tensor(head + [0] * (HEADER - len(head)), dtype=torch.int64)]
    parts += [p.contiguous() for p in (step, t) if p is not None]
    for work in [pg.send([p], dst, 0) for p in parts]:
        work.wait()


def recv(pg, src: int) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """(flag, step, tensor) of the next message from rank src of `pg`."""
    head = torch.empty(HEADER, dtype=torch.int64)
    pg.recv([head], src, 0).wait()
    flag, steps, code, ndim, *dims = head.tolist()
    step = t = None
    if steps:
        step = torch.empty(steps, dtype=torch.int64)
        pg.recv([step], src, 0).wait()
    if code >= 0:
        t = torch.empty(dims[:ndim], dtype=DTYPES[code])
        pg.recv([t], src, 0).wait()
    return flag, step, t


def error_text(rank: int, e: BaseException) -> torch.Tensor:
    return torch.tensor(list(f"pipeline stage {rank}: {type(e).__name__}: {e}".encode()), dtype=torch.uint8)


# ---------------------------------------------------------------------- the stages


def pipeline_plan(model: nn.Module, stages: int, config: EngineConfig) -> tuple[list[tuple[int, int]], int]:
    """(each stage's block range, the KV blocks of every stage's pool); ServeError naming the flag to change."""
    n = len(kv_geometry(model)[0])
    if not 1 <= stages <= n:
        raise ServeError(f"--pp {stages}: the model has {n} blocks; use --pp between 1 and {n}")
    bounds = stage_bounds(model, stages)
    widest = max(stop - start for start, stop in bounds)
    per_block = bytes_per_block(model, config.block_size) // n * widest
    num_blocks = int(config.kv_cache_mb * 2**20 // per_block)
    if num_blocks < 1:
        raise ServeError(f"--kv-cache-mb {config.kv_cache_mb:g} holds no block of {config.block_size} tokens for a "
                         f"stage of {widest} blocks ({per_block / 2**20:.3f} MB each); raise it")
    return bounds, num_blocks


def stage_of(model: nn.Module, bounds: list[tuple[int, int]], rank: int) -> nn.Module:
    """Stage `rank` of the model: training's cut (its blocks, the embedding first, the norm and head last)."""
    return pipeline_stage(model, bounds, rank).eval()


def stage_main(rank: int, world: int, store_path: str, ref: ModelRef, bounds: list[tuple[int, int]], num_blocks: int,
               block_size: int, threads: int, device: str, status) -> None:
    """Rank > 0: load the model, keep this stage of it, then run every forward that comes until a STOP."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        pg = dist.ProcessGroupGloo(dist.FileStore(store_path, world), rank, world, TIMEOUT)
        dev = torch_device(device, rank)
        part = stage_of(load_model(ref).module, bounds, rank).to(dev)  # the whole model is dropped here
        cache = PagedCache(part, num_blocks, block_size, dev)
        pools = (*cache.k.values(), *cache.v.values())
        status.put(("ready", rank, StageInfo(rank, os.getpid(), bounds[rank], sum(p.numel() for p in part.parameters()),
                                             tuple(cache.k), sum(t.numel() * t.element_size() for t in pools))))
    except BaseException:
        status.put(("failed", rank, traceback.format_exc()))
        return
    with torch.inference_mode():
        while stage_step(pg, rank, world, part, cache, dev):
            pass


def stage_step(pg, rank: int, world: int, part: nn.Module, cache: PagedCache, dev: torch.device) -> bool:
    """One forward's share on rank > 0: receive, run this stage, send on (the last stage to rank 0); False at STOP."""
    last = rank == world - 1
    flag, step, x = recv(pg, rank - 1)
    if flag == STOP:
        if not last:
            send(pg, rank + 1, STOP)
        return False
    chunks, copies, rows = decode_step(step) if step is not None else (None, [], None)
    for src, dst in copies:  # whatever befell the step upstream: rank 0's cache has them already
        cache.copy(src, dst)
    if flag == DATA:
        assert x is not None
        try:
            if chunks is None:
                x = part(x.to(dev)).cpu()
            else:
                x = part(x.to(dev), cache=cache.step(chunks) if rows is None else cache.step(chunks, rows)).cpu()
        except Exception as e:  # this step fails, the stage goes on
            flag, x = FAILED, error_text(rank, e)
    send(pg, 0 if last else rank + 1, flag, None if last else step, x)
    return True


class PipelineGroup:
    """Rank 0's side: the stage processes, their gloo group, and each forward's way through the stages."""

    def __init__(self, ref: ModelRef, bounds: list[tuple[int, int]], num_blocks: int, block_size: int, threads: int,
                 device: str = "cpu"):
        import torch.distributed as dist

        self.world, self.bounds, self.num_blocks, self.block_size = len(bounds), bounds, num_blocks, block_size
        self.stages: list[StageInfo | None] = [None] * self.world  # what each process holds, once ready
        self.down: str | None = None  # why no forward can run any more
        self.pg = None
        self._lock = threading.Lock()  # one forward through the stages at a time (the engine's, or /v2 infer's)
        self._copies: list[tuple[int, int]] = []  # block copies the stages have not been sent yet
        self._closing = False
        self._dir = tempfile.TemporaryDirectory(prefix="plait-pp-")  # the group's FileStore, removed with the group
        store = os.path.join(self._dir.name, "pp-store")
        self.status = CONTEXT.Queue()
        self.procs = [spawn(stage_main, (r, self.world, store, ref, bounds, num_blocks, block_size, threads, device,
                                         self.status), name=f"plait-pp-{r}", env=STAGE_ENV)
                      for r in range(1, self.world)]
        # Join on a thread: a stage that fails before it joins must fail the start, not hang it.
        joined: list = []

        def join() -> None:
            try:
                joined.append(dist.ProcessGroupGloo(dist.FileStore(store, self.world), 0, self.world, TIMEOUT))
            except BaseException as e:
                joined.append(e)

        joiner = threading.Thread(target=join, name="plait-pp-join", daemon=True)
        joiner.start()
        self._wait(lambda: not joiner.is_alive(), "join the group")
        if isinstance(joined[0], BaseException):
            self.abort()
            raise ServeError(f"--pp {self.world}: the stages' group did not form: {joined[0]}")
        self.pg = joined[0]

    def first_stage(self, model: nn.Module) -> nn.Module:
        """This process's model: stage 0 of `model`, its hidden states carried through the later stages by a hook."""
        part = stage_of(model, self.bounds, 0)
        part.register_forward_hook(self._onwards, with_kwargs=True)
        self.stages[0] = StageInfo(0, os.getpid(), self.bounds[0], sum(p.numel() for p in part.parameters()),
                                   tuple(kv_geometry(part)[0]), self.num_blocks * bytes_per_block(part, self.block_size))
        return part

    def wait_ready(self) -> None:
        """Every stage process holds its stage and its cache; then a watcher reports the first one that dies."""
        self._wait(lambda: all(self.stages[1:]), "load its stage")
        threading.Thread(target=self._watch, name="plait-pp-watch", daemon=True).start()

    def _wait(self, done, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT.total_seconds()
        while not done():
            try:
                kind, rank, detail = self.status.get(timeout=0.2)
            except queue.Empty:
                dead = [p for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.abort()
                    why = f"exited with {dead[0].exitcode}" if dead else f"timed out ({TIMEOUT.total_seconds():.0f} s)"
                    raise ServeError(f"--pp {self.world}: a stage process {why} before it could {what}") from None
                continue
            if kind == "failed":
                self.abort()
                raise ServeError(f"--pp {self.world}: stage {rank} failed to start:\n{detail}")
            self.stages[rank] = detail

    def _watch(self) -> None:
        ended = wait([p.sentinel for p in self.procs])
        if self._closing:
            return
        proc = next(p for p in self.procs if p.sentinel in ended)
        proc.join(timeout=1)
        self._mark_down(f"pipeline stage {self.procs.index(proc) + 1} (pid {proc.pid}) died with exit code "
                        f"{proc.exitcode}; the pipeline is down (restart the server)")

    def _mark_down(self, why: str) -> None:
        if self.down is None:
            self.down = why

    # ------------------------------------------------------------------ forwards

    def announce(self, ids: list[int], chunks: Sequence, copies: list[tuple[int, int]], rows=None) -> None:
        """The engine's hook before each forward: the block copies it made go with the next step."""
        self._copies += copies

    def _onwards(self, module: nn.Module, args: tuple, kwargs: dict, hidden: torch.Tensor) -> torch.Tensor:
        """Stage 0's forward hook: its output (hidden states) through the later stages; their logits replace it."""
        view = kwargs.get("cache", args[1] if len(args) > 1 else None)
        if isinstance(view, dict) or any(kwargs.get(k) is not None for k in ("pad", "pos")):
            raise RuntimeError("under --pp the model runs engine steps and plain forwards only, not a cache of its own")
        return self.through(hidden, view)

    def through(self, hidden: torch.Tensor, view) -> torch.Tensor:
        """Stage 0's hidden states through stages 1..K-1 (each over its cache when `view` is a paged step): the logits."""
        with self._lock:
            if self.down is not None:
                raise PipelineDown(self.down)
            step = None
            if view is not None:
                bs = self.block_size
                tables = [(table[:-(-(start + count) // bs)], start, count) for table, start, count in view.chunks]
                step, self._copies = encode_step(tables, self._copies, getattr(view, "row_list", None)), []
            try:
                send(self.pg, 1, DATA, step, hidden.detach().cpu())
                flag, _, out = recv(self.pg, self.world - 1)
            except RuntimeError as e:  # gloo: a stage process died, its connections closed
                raise PipelineDown(self._broken(e)) from None
        assert out is not None
        if flag == FAILED:
            raise RuntimeError(bytes(out.tolist()).decode(errors="replace"))
        return out.to(hidden.device)

    def _broken(self, error: BaseException) -> str:
        """Why the group failed: the stage that died, once the watcher has seen it (a moment after its sockets closed)."""
        deadline = time.monotonic() + 2.0
        while self.down is None and time.monotonic() < deadline:
            time.sleep(0.02)
        self._mark_down(f"the pipeline's group failed: {str(error).splitlines()[0] if str(error) else repr(error)}")
        assert self.down is not None
        return self.down

    # ------------------------------------------------------------------ the end

    def abort(self) -> None:
        """A start that failed: the stages killed (no STOP: they may not read it), the group left."""
        self._closing = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        if self.pg is not None:
            self.pg.shutdown()
            self.pg = None
        self._dir.cleanup()

    def close(self) -> None:
        """Stop every stage (a healthy group walks a STOP down them; a broken one is killed) and leave the group."""
        self._closing = True
        if self.down is None and self._lock.acquire(timeout=30):  # a forward in flight ends first
            try:
                send(self.pg, 1, STOP)
            except RuntimeError:
                pass  # a stage died as we stopped: it is killed below
            finally:
                self._lock.release()
            for p in self.procs:
                p.join(timeout=30)
        self.abort()
