"""Continual learning: data.stream trains over a sequence of tasks or data versions, one after the other.

    data.stream = [{classes = [0, 1, 2, 3, 4]}, {classes = [5, 6, 7, 8, 9]}]          # split digits: two tasks
    data.stream = [{path = "v1.npy"}, {path = "v2.npy", exclude = "audit/audit.json"}]  # the data engine's versions

Each entry is a set of [data] keys over the job's own; task t is the data they give. train.steps is cut into equal
spans, task t trained in steps [t * steps / T, (t + 1) * steps / T). With data.replay = r, a share r of every batch
after the first task is drawn from the earlier tasks' training samples (experience replay). Step s's batch is
drawn from (seed, s) alone, like the other samplers: every layout and a resumed run draw the same samples.

Validation is every task's validation split together; plait.train.continual evaluates each task's split alone at
the end of every task (the forgetting table) and adds EWC's penalty (train.ewc).
"""

from __future__ import annotations

import dataclasses

import torch

from plait.data.exclude import Subset
from plait.data.sampler import _epoch_seed, labels_of
from plait.data.spec import DataBundle
from plait.errors import DataError


class Concat:
    """Datasets one after the other: index i of the whole is index i - offset of the part it falls in."""

    def __init__(self, parts: list):
        self.parts = parts
        self.offsets = torch.tensor([0] + [len(p) for p in parts]).cumsum(0)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def fetch(self, idx: torch.Tensor):
        which = torch.bucketize(idx, self.offsets[1:], right=True)
        xs: list = [None] * len(idx)
        ys: list = [None] * len(idx)
        for k in which.unique().tolist():
            rows = (which == k).nonzero().flatten()
            x, y = self.parts[k].fetch(idx[rows] - self.offsets[k])
            for j, r in enumerate(rows.tolist()):
                xs[r], ys[r] = x[j], y[j]
        return torch.stack(xs), torch.stack(ys)


class StreamSampler:
    """Step s's global batch: from task task_at(s), a share `replay` of it from the tasks before (module docstring)."""

    def __init__(self, sizes: list[int], global_batch_size: int, seed: int, steps: int, replay: float = 0.0):
        self.sizes, self.batch, self.seed, self.steps, self.replay = sizes, global_batch_size, seed, steps, replay
        self.offsets = [sum(sizes[:t]) for t in range(len(sizes))]
        self.n = sum(sizes)  # the loader numbers epochs by it (augmentation seeds)

    def task_at(self, step: int) -> int:
        return min(len(self.sizes) - 1, step * len(self.sizes) // self.steps)

    def boundaries(self) -> list[int]:
        """The first step of each task after the first."""
        return [-(-t * self.steps // len(self.sizes)) for t in range(1, len(self.sizes))]

    def global_batch(self, step: int) -> torch.Tensor:
        t = self.task_at(step)
        g = torch.Generator().manual_seed(_epoch_seed(self.seed ^ 0x57AEA3, step))
        old = round(self.replay * self.batch) if t > 0 else 0
        now = _draw(self.sizes[t], self.batch - old, g) + self.offsets[t]
        if not old:
            return now
        return torch.cat([now, _draw(self.offsets[t], old, g)])  # the earlier tasks' samples are indices 0..offset


def _draw(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """k of range(n): without replacement when n allows."""
    return torch.randperm(n, generator=g)[:k] if n >= k else torch.randint(0, n, (k,), generator=g)


def keep_classes(bundle: DataBundle, classes: list[int], name: str) -> DataBundle:
    """data.classes: the bundle's samples of these classes alone (both splits; labels unchanged)."""
    if bundle.spec.task != "classification":
        raise DataError(f"data.classes keeps some classes of a classification source; data.name = {name!r} is a "
                        f"{bundle.spec.task!r} task: leave data.classes empty")
    bad = [c for c in classes if not 0 <= c < bundle.spec.num_classes]
    if bad:
        raise DataError(f"data.classes = {classes}: {bad} not among this source's classes 0..{bundle.spec.num_classes - 1}")
    want = torch.tensor(classes)
    parts = []
    for split in (bundle.train, bundle.val):
        keep = torch.isin(labels_of(split), want).nonzero().flatten()
        parts.append(Subset(split, keep))
    return dataclasses.replace(bundle, train=parts[0], val=parts[1])


def stream_bundle(data_cfg, model_cfg, build) -> DataBundle:
    """data.stream's tasks, each `build(data keys)` of its entry over data_cfg, joined: training and validation in
    task order (Concat), each task's (train, val) in `tasks`."""
    bundles = []
    for k, entry in enumerate(data_cfg.stream):
        cfg = dataclasses.replace(data_cfg, stream=[], **entry)
        b = build(cfg, model_cfg)
        if bundles and (b.spec.task, b.spec.input_shape, b.spec.num_classes) != (
                bundles[0].spec.task, bundles[0].spec.input_shape, bundles[0].spec.num_classes):
            s0 = bundles[0].spec
            raise DataError(f"data.stream[{k}] gives {b.spec.task} data of shape {b.spec.input_shape} with "
                            f"{b.spec.num_classes} classes, data.stream[0] {s0.task} data of shape {s0.input_shape} "
                            f"with {s0.num_classes}: one model trains on every task, so they must agree")
        if len(b.train) == 0 or len(b.val) == 0:
            raise DataError(f"data.stream[{k}] = {entry} leaves no training or no validation samples")
        bundles.append(b)
    first = bundles[0]
    return dataclasses.replace(first, train=Concat([b.train for b in bundles]), val=Concat([b.val for b in bundles]),
                               tasks=[(b.train, b.val) for b in bundles])
