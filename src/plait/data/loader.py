"""Per-step batches for one data-parallel rank, prepared ahead of compute by a background thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import torch

from plait.data.sampler import GlobalBatchSampler, micro_batches, shard

Batch = tuple[torch.Tensor, torch.Tensor]


class StepLoader:
    """Yields, for each step in [start, stop), this rank's list of micro-batches (inputs, targets)."""

    def __init__(self, dataset, sampler: GlobalBatchSampler, start: int, stop: int, dp_rank: int, dp: int,
                 micro: int, prefetch: int = 2, pin_memory: bool = False):
        self.dataset, self.sampler = dataset, sampler
        self.start, self.stop = start, stop
        self.dp_rank, self.dp, self.micro = dp_rank, dp, micro
        self.prefetch, self.pin = prefetch, pin_memory

    def _make(self, step: int) -> list[Batch]:
        idx = shard(self.sampler.global_batch(step), self.dp_rank, self.dp)
        out = []
        at = getattr(self.dataset, "fetch_at", None)  # datasets whose samples depend on the step (augmented views)
        for mb in micro_batches(idx, self.micro):
            x, y = at(mb, step) if at is not None else self.dataset.fetch(mb)
            if self.pin:
                x, y = x.pin_memory(), y.pin_memory()
            out.append((x, y))
        return out

    def __iter__(self) -> Iterator[list[Batch]]:
        if self.prefetch <= 0:
            for step in range(self.start, self.stop):
                yield self._make(step)
            return
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def work() -> None:
            # A blocking put, no polling: a thread that wakes up on a timer steals CPU and the GIL
            # from the training thread when each rank has a single core.
            try:
                for step in range(self.start, self.stop):
                    if stop.is_set():
                        return
                    q.put(self._make(step))
            except BaseException as e:  # surfaced in the consumer
                q.put(e)

        t = threading.Thread(target=work, name="plait-prefetch", daemon=True)
        t.start()
        try:
            for _ in range(self.start, self.stop):
                item = q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while t.is_alive():  # unblock a producer waiting on a full queue so that it sees `stop`
                try:
                    q.get_nowait()
                except queue.Empty:
                    t.join(timeout=0.01)
