"""Data parallel on devices of unequal speed: each rank's share of the global batch follows its speed.

`parallel.hetero = "auto"` measures every rank's compute time per sample and, every `parallel.hetero_every` steps,
gives each rank a share of the global batch proportional to its throughput; `parallel.hetero = "1,3"` fixes the
relative speeds instead. The global batch stays the same samples in the same order (the shares are consecutive
slices of it) and every micro-batch's loss is weighted by its samples over the global batch (not over the rank's
batch), so the averaged gradient is the global batch's mean gradient whatever the split: the trajectory is the
homogeneous run's. A rank only ever waits for the slowest one's share, which shrinks.

New shares take effect `hetero_every` steps after they are measured: the loader prepares batches ahead of compute
(at most `data.prefetch` + 1 steps), so a later step is the first that no rank has sliced yet.
"""

from __future__ import annotations

import threading

import torch

from plait.callback import Callback
from plait.errors import ConfigError
from plait.parallel.keys import HeteroKeys
from plait.parallel.scheme import Build
from plait.parallel.schemes.hetero import parse


def split_counts(total: int, speeds: list[float]) -> list[int]:
    """`total` samples in shares proportional to `speeds` (largest remainder), every rank at least one."""
    n = len(speeds)
    if total < n:
        raise ConfigError(f"a global batch of {total} cannot give each of {n} data-parallel ranks a sample")
    s = sum(speeds)
    exact = [1 + (total - n) * v / s for v in speeds]
    counts = [int(e) for e in exact]
    for i in sorted(range(n), key=lambda i: (counts[i] - exact[i], i))[:total - sum(counts)]:
        counts[i] += 1
    return counts


class HeteroShares:
    """The per-step sample counts of every dp rank, and (auto) their re-measurement."""

    def __init__(self, speeds: list[float], dp: int, global_batch: int, every: int, group=None, start: int = 0):
        self.dp, self.global_batch, self.every, self.group = dp, global_batch, every, group
        self.auto = not speeds
        first = split_counts(global_batch, speeds or [1.0] * dp)
        self._schedule: list[tuple[int, list[int]]] = [(start, first)]  # (from step, counts), appended in order
        self._lock = threading.Lock()
        self._seconds = 0.0
        self._samples = 0
        self.step = start
        self.history: list[dict] = []  # every re-split: step, measured speeds, new counts, from which step

    def counts(self, step: int) -> list[int]:
        """Samples of each dp rank at `step` (the loader's thread asks ahead of compute)."""
        with self._lock:
            return next(c for s, c in reversed(self._schedule) if s <= step)

    def offsets(self, step: int, rank: int) -> tuple[int, int]:
        """This rank's slice [begin, end) of the step's global batch."""
        c = self.counts(step)
        begin = sum(c[:rank])
        return begin, begin + c[rank]

    def add(self, seconds: float, samples: int) -> None:
        """This rank computed `samples` samples in `seconds` (collective waits excluded) at this step."""
        self._seconds += max(0.0, seconds)
        self._samples += samples

    def fields(self) -> dict:
        """For every metrics record: the samples each rank computed at the step just logged."""
        return {"batch_shares": self.counts(self.step - 1)}

    def after_step(self, step: int, device) -> list[dict]:
        """Every `every` steps (auto): one all-gather of each rank's seconds per sample, then new shares.
        Returns the re-split as an event record for metrics.jsonl (none on other steps)."""
        self.step = step
        if not self.auto or step % self.every:
            return []
        import torch.distributed as dist

        mine = torch.tensor([self._seconds, float(self._samples)], dtype=torch.float64, device=device)
        every = [torch.zeros_like(mine) for _ in range(self.dp)]
        dist.all_gather(every, mine, group=self.group)
        self._seconds, self._samples = 0.0, 0
        rates = [float(t[1] / t[0]) if t[0] > 0 and t[1] > 0 else 0.0 for t in every]
        if min(rates) <= 0:
            return []
        counts = split_counts(self.global_batch, rates)
        begin = step + self.every
        with self._lock:
            self._schedule.append((begin, counts))
        event = {"step": step, "event": "hetero_resplit", "samples_per_s": [round(r, 1) for r in rates],
                 "counts": counts, "from_step": begin + 1}  # metrics count steps from 1: the step after `begin`
        self.history.append(event)
        return [event]


class HeteroCallback(Callback):
    """The shares in the training loop: each rank's compute measured, re-split on schedule, saved in checkpoints."""

    name = "hetero"

    def __init__(self, shares: HeteroShares, device):
        self.shares, self.device = shares, device
        self.batch_slices = shares.offsets  # the loader slices each step's global batch by the shares

    def after_compute(self, step: int, seconds: float, samples: int) -> None:
        self.shares.add(seconds, samples)

    def on_step_end(self, step: int) -> list[dict]:
        return self.shares.after_step(step, self.device)  # auto: re-measured, re-split every hetero_every steps

    def fields(self) -> dict:
        return self.shares.fields()

    def state_dict(self) -> dict:
        return {"schedule": [[s, c] for s, c in self.shares._schedule], "history": self.shares.history}

    def load_state_dict(self, state: dict) -> None:
        with self.shares._lock:
            self.shares._schedule = [(int(s), list(c)) for s, c in state["schedule"]]
        self.shares.history = list(state["history"])


def callbacks(b: Build, strategy) -> list:
    keys = b.keys(HeteroKeys)
    shares = HeteroShares(parse(keys.hetero, b.layout.dp) or [], b.layout.dp, b.layout.global_batch, keys.hetero_every,
                          b.rt.axis_group("dp"))
    return [HeteroCallback(shares, b.rt.device)]
