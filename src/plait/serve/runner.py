"""Run one batch on a loaded model: the code every executor shares (server thread, replica process).

Tasks are plain picklable tuples, so the same `Runner.run` serves in-process and behind a pipe:

    ("infer", array)         -> {output name: array}
    ("generate", [GenRow])   -> [[new token ids] per row]

Exact batching: classifier batches are padded with zero rows to a fixed `pad_to` rows, so a
request's rows go through the same matrix kernels (same shapes, same reduction order) whether
it ran alone or merged with others; its answer is then bitwise the one it gets alone. CPU GEMM
kernels pick their blocking from the matrix shape, which is why an unpadded batch of 7 and a
batch of 1 can differ in the last bit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from plait.serve.kvcache import GenRow, generate
from plait.serve.model import ServedModel

Emit = Callable[[int, int, int], None]  # (row, position, token)


class Runner:
    def __init__(self, served: ServedModel, pad_to: int | None = None):
        self.served = served
        self.pad_to = pad_to if not served.is_lm else None  # lm answers are compared by tokens, not bits

    @torch.inference_mode()
    def infer(self, x: np.ndarray) -> dict[str, np.ndarray]:
        t = torch.from_numpy(np.ascontiguousarray(x) if x.flags.writeable else x.copy())  # frombuffer views are read-only
        n = t.shape[0]
        if self.pad_to and n < self.pad_to:
            t = torch.cat([t, t.new_zeros(self.pad_to - n, *t.shape[1:])])
        logits = self.served.module(t)[:n].float()
        out = {"logits": logits.numpy()}
        if not self.served.is_lm:
            out["label"] = logits.argmax(-1).numpy()
        return out

    def generate(self, rows: list[GenRow], emit: Emit | None = None,
                 cancelled: Callable[[int], bool] | None = None) -> list[list[int]]:
        return generate(self.served.module, rows, emit, cancelled)

    def run(self, task: tuple, emit: Emit | None = None, cancelled: Callable[[int], bool] | None = None) -> Any:
        kind, payload = task
        if kind == "infer":
            return self.infer(payload)
        if kind == "generate":
            return self.generate(payload, emit, cancelled)
        raise ValueError(f"unknown task kind {kind!r}")


class LocalExecutor:
    """The model in the server process; batches run one at a time on a worker thread (the event loop stays free)."""

    capacity = 1
    restarts = 0

    def __init__(self, runner: Runner):
        self.runner = runner
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plait-model")

    async def start(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    async def run(self, task: tuple, on_event: Emit | None = None, cancelled: Callable[[int], bool] | None = None) -> Any:
        loop = asyncio.get_running_loop()
        emit = None if on_event is None else (lambda *a: loop.call_soon_threadsafe(on_event, *a))
        return await loop.run_in_executor(self._pool, self.runner.run, task, emit, cancelled)

    async def stop(self) -> None:
        self._pool.shutdown(wait=True)
