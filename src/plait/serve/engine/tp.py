"""`plait serve --tp N`: tensor-parallel generation, the model split by its Megatron plan over N processes.

The server process is rank 0 and N - 1 worker processes are the others, joined by torch.distributed (gloo on
CPU; the same code takes NCCL's path where the model is on GPUs). Every rank loads the model and keeps its
1/N of each split matrix (plait.parallel.tp.apply_tp: q/k/v and gate/up by columns, o/down by rows, the
embedding and head by vocabulary), and a paged KV cache of the same blocks holding its own kv_heads / N heads:
each rank holds 1/N of the weights and of the cache.

Rank 0 runs the engine (scheduler, sampling, HTTP). Before each forward it broadcasts the step: the packed
token ids, each chunk's block table, first position and length, and the block copies made since the last one
(copy-on-write); every rank then runs the same forward on its shard, and the collectives inside (the row-parallel
all-reduces, the head's all-gather) line up. Only rank 0 reads the logits. Greedy tokens equal tp = 1's.
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

from plait.errors import ConfigError
from plait.procs import CONTEXT, spawn
from plait.serve.engine.paged import PagedCache
from plait.serve.errors import ServeError
from plait.serve.model.load import ModelRef, load_model

WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


class TensorParallelDown(ServeError):
    """A rank of --tp died: no forward can run any more (the server answers 503 and is not ready)."""


def shard(module, world: int):
    """The module split over every rank of the default group (its plan's matrices, in place)."""
    from torch.distributed.device_mesh import init_device_mesh

    from plait.parallel.tp import apply_tp  # lazily: only --tp needs DTensor (about 0.5 s of imports)

    mesh = init_device_mesh("cpu", (world,))
    try:
        return apply_tp(module, mesh, sequence_parallel=False)
    except ConfigError as e:
        raise ServeError(f"--tp {world}: {e}") from None


def worker_main(rank: int, world: int, store_path: str, ref: ModelRef, num_blocks: int, block_size: int,
                threads: int, status) -> None:
    """Rank > 0: load, shard, then run every forward rank 0 announces, until it says stop."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
        module = shard(load_model(ref).module, world).eval()
        cache = PagedCache(module, num_blocks, block_size, tp=world)
        status.put(("ready", rank, os.getpid()))
    except BaseException:
        status.put(("failed", rank, traceback.format_exc()))
        return
    with torch.inference_mode():
        while True:
            message: list = [None]
            dist.broadcast_object_list(message, src=0)
            kind, payload = message[0]
            if kind == "stop":
                break
            ids, chunks, copies, rows = payload
            for src, dst in copies:
                cache.copy(src, dst)
            module(torch.tensor([ids]), cache=cache.step(chunks, rows))
    dist.destroy_process_group()


class TensorParallelGroup:
    """Rank 0's side: the workers, the process group, and the announcement of each forward."""

    def __init__(self, ref: ModelRef, world: int, num_blocks: int, block_size: int, threads: int):
        import torch.distributed as dist

        self.world = world
        self.down: str | None = None  # why no forward can run any more (a rank died)
        self._ready = 0  # ranks holding their shard
        self._dir = tempfile.TemporaryDirectory(prefix="plait-tp-")  # the group's FileStore, removed with the group
        store = os.path.join(self._dir.name, "tp-store")
        self.status = CONTEXT.Queue()
        self.procs = [spawn(worker_main, (r, world, store, ref, num_blocks, block_size, threads, self.status),
                            name=f"plait-tp-{r}", env=WORKER_ENV) for r in range(1, world)]
        # Join the group on a thread: a rank that fails before it joins must fail the start, not hang it.
        joined: list[BaseException | None] = []

        def join() -> None:
            try:
                dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=0, world_size=world,
                                        timeout=datetime.timedelta(seconds=600))
                joined.append(None)
            except BaseException as e:
                joined.append(e)

        joiner = threading.Thread(target=join, name="plait-tp-join", daemon=True)
        joiner.start()
        self._wait(lambda: not joiner.is_alive(), "join the process group")
        if joined and joined[0] is not None:
            self._kill()
            raise ServeError(f"--tp {world}: the process group did not form: {joined[0]}")

    def wait_ready(self) -> None:
        """After rank 0 has sharded its model too (the sharding is collective): every other rank holds its shard."""
        self._wait(lambda: self._ready == self.world - 1, "load and shard the model")

    def _wait(self, done, what: str) -> None:
        world = self.world
        deadline = time.monotonic() + 600
        while not done():
            try:
                kind, rank, detail = self.status.get(timeout=0.2)
            except queue.Empty:
                dead = [p for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self._kill()
                    why = f"exited with {dead[0].exitcode}" if dead else "timed out (600 s)"
                    raise ServeError(f"--tp {world}: a worker process {why} before it could {what}") from None
                continue
            if kind == "failed":
                self._kill()
                raise ServeError(f"--tp {world}: rank {rank} failed to start:\n{detail}")
            self._ready += 1

    def abort(self) -> None:
        """A start that failed on rank 0: the workers killed, the group left (no stop message: they may not read it)."""
        import torch.distributed as dist

        self._kill()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)

    def announce(self, ids: list[int], chunks: Sequence, copies: list[tuple[int, int]],
                 rows: list[int] | None = None) -> None:
        import torch.distributed as dist

        if self.down is not None:
            raise TensorParallelDown(self.down)
        try:
            dist.broadcast_object_list([("step", (ids, list(chunks), copies, rows))], src=0)
        except RuntimeError as e:  # gloo: a rank's connections closed
            raise self.broken(e) or e from None

    def broken(self, error: BaseException) -> TensorParallelDown | None:
        """After a collective failed: TensorParallelDown naming the rank that died (the group is down from then
        on), or None when every rank is alive (the error is the step's own)."""
        deadline = time.monotonic() + 2.0  # a rank's process is reaped a moment after its sockets close
        while not (dead := [(r, p) for r, p in enumerate(self.procs, 1) if not p.is_alive()]):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)
        if self.down is None:
            ranks = ", ".join(f"rank {r} (pid {p.pid}, exit code {p.exitcode})" for r, p in dead)
            self.down = f"--tp {self.world}: {ranks} died ({str(error).splitlines()[0][:120]}); restart the server"
        return TensorParallelDown(self.down)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                if self.down is None:  # a broken group cannot carry the stop: its ranks are killed below
                    dist.broadcast_object_list([("stop", None)], src=0)
            finally:
                dist.destroy_process_group()
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
