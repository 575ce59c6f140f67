"""A user's own code, as plait imports it by name: datasets, a loss and a metric (tests of data.factory and plait.api)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Digits:
    """scikit-learn's digits as a plain map-style dataset: (64 floats, int label) per sample, no fetch()."""

    def __init__(self, limit: int = 0):
        from sklearn.datasets import load_digits

        d = load_digits()
        self.x = torch.from_numpy(d.data).float() / 16.0
        self.y = d.target.tolist()
        if limit:
            self.x, self.y = self.x[:limit], self.y[:limit]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def digits(limit: int = 0) -> Digits:
    return Digits(limit)


def digits_pair(limit: int = 400):
    """(train, val): the factory's own split."""
    d = Digits(limit)
    n_val = limit // 5
    return torch.utils.data.Subset(d, range(n_val, limit)), torch.utils.data.Subset(d, range(n_val))


class _Dicts(Digits):
    """Samples as dicts, with the dataset's own collate."""

    def __getitem__(self, i: int):
        return {"pixels": self.x[i], "label": self.y[i]}

    def collate(self, samples):
        return torch.stack([s["pixels"] for s in samples]), torch.tensor([s["label"] for s in samples])


def digits_dicts(limit: int = 0) -> _Dicts:
    return _Dicts(limit)


def not_a_dataset():
    return iter(range(10))


class _Ragged(Digits):
    def __getitem__(self, i: int):
        return self.x[i][: 64 - (i % 2)], self.y[i]


def ragged():
    return _Ragged(100)


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets)


def error_rate(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(-1) != targets).float().mean()


def tiny_mlp(inputs: int = 64, classes: int = 10) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(inputs, 16), torch.nn.ReLU(), torch.nn.Linear(16, classes))
