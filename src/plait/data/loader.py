"""Per-step batches for one data-parallel rank, prepared ahead of compute by a background thread."""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
from collections.abc import Generator, Iterator

import torch

from plait.data.sampler import GlobalBatchSampler, micro_batches, shard

Batch = tuple[torch.Tensor, torch.Tensor]
log = logging.getLogger("plait.data")


def fetch_micro(dataset, mb: torch.Tensor, step: int, epochs: torch.Tensor) -> Batch:
    """One micro-batch: samples `mb`, drawn at `step`, each in its epoch (its place in the stream // dataset size)."""
    at = getattr(dataset, "fetch_at", None)  # datasets whose samples depend on the step (contrastive views)
    if at is not None:
        return at(mb, step)
    by_epoch = getattr(dataset, "fetch_epoch", None)  # augmented images: seeded per (seed, index, epoch)
    if by_epoch is not None:
        return by_epoch(mb, epochs)
    return dataset.fetch(mb)


class _MicroBatches(torch.utils.data.Dataset):
    """For worker processes: a key (indices, step, epochs) -> that micro-batch; the DataLoader keeps the keys' order."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __getitem__(self, key) -> Batch:
        return fetch_micro(self.dataset, *key)


class StepLoader:
    """Yields, for each step in [start, stop), this rank's list of micro-batches (inputs, targets).

    workers > 0: micro-batches are fetched (decoded, augmented) by that many worker processes of a
    torch DataLoader, which returns them in order, so the batches are exactly those of workers = 0.
    """

    def __init__(self, dataset, sampler: GlobalBatchSampler, start: int, stop: int, dp_rank: int, dp: int,
                 micro: int, prefetch: int = 2, pin_memory: bool = False, workers: int = 0, slices=None, transform=None):
        self.dataset, self.sampler = dataset, sampler
        self.start, self.stop = start, stop
        self.dp_rank, self.dp, self.micro = dp_rank, dp, micro
        self.prefetch, self.pin, self.workers = prefetch, pin_memory, workers
        self.slices = slices  # (step, dp rank) -> [begin, end) of the global batch (parallel.hetero); None: equal
        self.transform = transform  # (inputs, targets) -> what the step takes (context parallel's cut); None: as is

    def _plan(self, step: int) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """(indices, step, epochs) of each of this rank's micro-batches at `step`."""
        if self.slices is not None:
            begin, end = self.slices(step, self.dp_rank)
            idx = self.sampler.global_batch(step)[begin:end]
        else:
            idx = shard(self.sampler.global_batch(step), self.dp_rank, self.dp)
            begin = self.dp_rank * len(idx)
        per = len(idx)
        first = step * self.sampler.batch + begin  # this slice's place in the sampler's stream
        epochs = (first + torch.arange(per)) // self.sampler.n
        return [(mb, step, ep) for mb, ep in zip(micro_batches(idx, self.micro), micro_batches(epochs, self.micro))]

    def _make(self, step: int) -> list[Batch]:
        out = []
        for mb, s, ep in self._plan(step):
            x, y = fetch_micro(self.dataset, mb, s, ep)
            if self.pin:
                x, y = x.pin_memory(), y.pin_memory()
            out.append((x, y))
        return out

    def _from_workers(self) -> Iterator[list[Batch]]:
        keys = (p for step in range(self.start, self.stop) for p in self._plan(step))  # lazily, in step order
        loader = torch.utils.data.DataLoader(
            _MicroBatches(self.dataset), batch_size=None, sampler=keys, num_workers=self.workers,
            pin_memory=self.pin, prefetch_factor=max(2, self.prefetch), in_order=True)
        it = iter(loader)
        try:
            for step in range(self.start, self.stop):
                yield [next(it) for _ in range(len(self._plan(step)))]
        finally:
            del it  # shuts the workers down

    def __iter__(self) -> Generator[list[Batch], None, None]:
        if self.transform is None:
            yield from self._steps()
            return
        for batches in self._steps():
            yield [self.transform(b) for b in batches]

    def _steps(self) -> Generator[list[Batch], None, None]:
        if self.workers > 0 and self.stop > self.start:
            if not multiprocessing.current_process().daemon:
                yield from self._from_workers()
                return
            # a daemonic process (a test harness's rank) may not start workers: the same batches, from the thread
            log.warning("data.workers = %d ignored: this process is daemonic and cannot start worker processes",
                        self.workers)
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
