"""The data order: (seed, step) -> the global batch's sample indices, and nothing else.

Indices come from a stream of per-epoch permutations of the dataset; step s takes
stream[s*B : (s+1)*B]. Data-parallel rank r takes a contiguous slice of that batch
and its gradient-accumulation micro-batches are slices of the slice. A checkpoint
therefore needs only the step to resume the data position, at any layout.
"""

from __future__ import annotations

import torch

from plait.data.datasets import Tensors
from plait.errors import DataError

_MIX = 0x9E3779B97F4A7C15


def _epoch_seed(seed: int, epoch: int) -> int:
    return (seed * _MIX + epoch * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


class GlobalBatchSampler:
    def __init__(self, num_samples: int, global_batch_size: int, seed: int):
        if num_samples <= 0:
            raise ValueError("the dataset is empty")
        self.n = num_samples
        self.batch = global_batch_size
        self.seed = seed
        self._cache: tuple[int, torch.Tensor] | None = None

    def _perm(self, epoch: int) -> torch.Tensor:
        if self._cache is None or self._cache[0] != epoch:
            g = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._cache = (epoch, torch.randperm(self.n, generator=g))
        return self._cache[1]

    def global_batch(self, step: int) -> torch.Tensor:
        """Sample indices of the global batch at `step`."""
        start, stop = step * self.batch, (step + 1) * self.batch
        parts = []
        while start < stop:
            epoch, offset = divmod(start, self.n)
            take = min(stop - start, self.n - offset)
            parts.append(self._perm(epoch)[offset:offset + take])
            start += take
        return torch.cat(parts)


class BalancedBatchSampler:
    """data.sampler = "balanced": every global batch is drawn with replacement, each class equally likely.

    Step s's batch comes from a generator seeded by (seed, s) alone, so it is still a function of
    (seed, step): the same at every layout, and a resumed run draws what the uninterrupted one drew.
    """

    def __init__(self, labels: torch.Tensor, global_batch_size: int, seed: int):
        labels = torch.as_tensor(labels).long()
        if len(labels) == 0:
            raise ValueError("the dataset is empty")
        self.n, self.batch, self.seed = len(labels), global_batch_size, seed
        w = 1.0 / torch.bincount(labels)[labels].double()
        self.weights = w / w.sum()

    def global_batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_epoch_seed(self.seed ^ 0xBA1A5CED, step))
        return torch.multinomial(self.weights, self.batch, replacement=True, generator=g)


def balanced_class_weights(labels: torch.Tensor, classes: int) -> list[float]:
    """n / (classes * count of the class), scikit-learn's "balanced"; classes with no sample get weight 0."""
    counts = torch.bincount(torch.as_tensor(labels).long(), minlength=classes).double()
    w = torch.where(counts > 0, len(labels) / (classes * counts.clamp(min=1)), torch.zeros_like(counts))
    return [float(v) for v in w]


def make_sampler(dataset, global_batch_size: int, seed: int, kind: str = "shuffle"):
    """data.sampler: "shuffle" (a permutation per epoch) or "balanced" (classes equally likely)."""
    if kind == "balanced":
        return BalancedBatchSampler(labels_of(dataset), global_batch_size, seed)
    return GlobalBatchSampler(len(dataset), global_batch_size, seed)


def shard(indices: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s contiguous slice of a batch that divides evenly by `world`."""
    per = len(indices) // world
    return indices[rank * per:(rank + 1) * per]


def micro_batches(indices: torch.Tensor, micro: int) -> list[torch.Tensor]:
    return [indices[i:i + micro] for i in range(0, len(indices), micro)]


def labels_of(dataset) -> torch.Tensor:
    """The class label of every sample of a classification dataset, without decoding its inputs."""
    inner, keep = getattr(dataset, "dataset", None), getattr(dataset, "keep", None)
    if inner is not None and keep is not None:  # a Subset (data.exclude)
        return labels_of(inner)[keep]
    if isinstance(dataset, Tensors):
        return dataset.y.long()
    if isinstance(getattr(dataset, "labels", None), list):  # an image folder
        return torch.tensor(dataset.labels, dtype=torch.long)
    stored = getattr(dataset, "stored_labels", None)  # packed splits: recorded when packed
    if stored is not None:
        return stored
    if inner is not None:  # an augmenting wrapper
        return labels_of(inner)
    raise DataError("data.sampler = 'balanced' and data.class_weights = 'balanced' need class labels; this data has "
                    "none (or was packed without them: pack it again)")
