"""Map-style datasets that fetch a whole batch of indices at once."""

from __future__ import annotations

import numpy as np
import torch

from plait.data.spec import SPLIT_SEED
from plait.errors import DataError


class TokenWindows:
    """Non-overlapping windows of a token stream: sample i is tokens[i*T : i*T + T + 1],
    split into inputs [:-1] and next-token targets [1:]."""

    def __init__(self, tokens: np.ndarray | torch.Tensor, context: int):
        self.tokens = torch.as_tensor(tokens)
        self.context = context
        self._offsets = torch.arange(context + 1)

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.context)

    def fetch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        win = self.tokens[idx[:, None] * self.context + self._offsets].long()
        return win[:, :-1], win[:, 1:]


class DocumentWindows(TokenWindows):
    """TokenWindows of a stream of documents (data.pack = true on text): inputs (n, 2, T) of ids and positions, a
    position restarting at 0 at each document's first token and at each window's, so that attention stays inside
    documents (plait.models.decoder.packed_mask) and positions inside the model's context."""

    def __init__(self, tokens: np.ndarray | torch.Tensor, starts: np.ndarray | torch.Tensor, context: int):
        super().__init__(tokens, context)
        self.starts = torch.as_tensor(starts, dtype=torch.long)  # each document's first token in the stream, ascending

    def fetch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().fetch(idx)
        first = idx[:, None] * self.context
        at = first + self._offsets[:-1]
        doc = self.starts[(torch.searchsorted(self.starts, at, right=True) - 1).clamp(min=0)]
        return torch.stack([x, at - torch.maximum(doc, first)], 1), y


class Tensors:
    """Inputs and labels held in memory."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        if len(x) != len(y):
            raise ValueError(f"inputs ({len(x)}) and labels ({len(y)}) differ in length")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def fetch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[idx], self.y[idx]


def eval_batches(dataset, samples: int, batch_size: int) -> list[torch.Tensor]:
    """The fixed validation set: the first `samples` samples in batches of `batch_size`."""
    n = min(samples, len(dataset))
    return [torch.arange(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


def split_tensors(name: str, x: torch.Tensor, y: torch.Tensor, val_fraction: float) -> tuple[Tensors, Tensors]:
    """Train and validation rows of in-memory tensors, by a permutation that depends only on SPLIT_SEED."""
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_val = max(1, int(len(x) * val_fraction))
    if n_val >= len(x):
        raise DataError(f"data.name = {name!r} has only {len(x)} samples: too few to hold out a validation set")
    v, t = perm[:n_val], perm[n_val:]
    train, val = Tensors(x[t], y[t]), Tensors(x[v], y[v])
    train.source_index, val.source_index = t, v  # each sample's row in the source (audits name samples by it)
    return train, val
