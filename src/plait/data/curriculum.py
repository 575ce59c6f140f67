"""data.curriculum: the easiest samples first, the pool growing with the steps (Bengio et al. 2009; DLS ch. 10).

    data.curriculum = {score = "length", pacing = "root", start = 0.2, full_at = 0.5}

Every training sample has a difficulty score: "length" (a text sample's trained tokens; instruction data varies),
"loss" (its loss under a trained model: curriculum.model, a run directory, else train.init_from), or a JSON file
of one number per sample. Samples are ranked by score (ties by index). At step s the batch is drawn, without
replacement, from the easiest ceil(f(s) n) samples, where

    f(s) = start + (1 - start) g(min(1, s / (full_at * train.steps))),   g = x (linear) or sqrt(x) (root)

(the competence functions of Platanios et al. 2019), from a generator seeded by (seed, step): like the other
samplers a function of (seed, step) alone, so every layout and a resumed run draw what one process draws.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from plait.data.sampler import _epoch_seed
from plait.errors import DataError

PACINGS = ("linear", "root")


def pool_fraction(step: int, steps: int, start: float, full_at: float, pacing: str) -> float:
    x = min(1.0, step / max(1.0, full_at * steps))
    return start + (1.0 - start) * (math.sqrt(x) if pacing == "root" else x)


class CurriculumSampler:
    def __init__(self, scores: torch.Tensor, global_batch_size: int, seed: int, steps: int, start: float = 0.2,
                 full_at: float = 0.5, pacing: str = "linear"):
        scores = torch.as_tensor(scores, dtype=torch.float64)
        if len(scores) == 0:
            raise ValueError("the dataset is empty")
        if not torch.isfinite(scores).all():
            raise DataError("data.curriculum: a sample's score is not a finite number")
        self.n, self.batch, self.seed, self.steps = len(scores), global_batch_size, seed, steps
        self.start, self.full_at, self.pacing = start, full_at, pacing
        self.order = torch.from_numpy(scores.numpy().argsort(kind="stable"))  # easiest first, ties by index

    def pool(self, step: int) -> int:
        """How many of the easiest samples step `step` draws from (at least one batch's worth, at most all)."""
        f = pool_fraction(step, self.steps, self.start, self.full_at, self.pacing)
        return min(self.n, max(self.batch, math.ceil(f * self.n)))

    def global_batch(self, step: int) -> torch.Tensor:
        size = self.pool(step)
        g = torch.Generator().manual_seed(_epoch_seed(self.seed ^ 0xC0441C, step))
        if size >= self.batch:
            pick = torch.randperm(size, generator=g)[:self.batch]
        else:  # a dataset smaller than one batch: with replacement
            pick = torch.randint(0, size, (self.batch,), generator=g)
        return self.order[pick]


def scores_from_file(path: str | Path, n: int) -> torch.Tensor:
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"data.curriculum.score = {str(path)!r}: not a readable JSON file ({e})") from None
    if not (isinstance(values, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)):
        raise DataError(f"data.curriculum.score = {str(path)!r} must hold a JSON list of numbers, one per training sample")
    if len(values) != n:
        raise DataError(f"data.curriculum.score = {str(path)!r} has {len(values)} scores; the training split has {n} "
                        "samples")
    return torch.tensor(values, dtype=torch.float64)


def length_scores(dataset) -> torch.Tensor:
    """Each sample's trained tokens (targets that are not -100): instruction and chat data vary, text windows do not."""
    out = []
    for lo in range(0, len(dataset), 256):
        _, y = dataset.fetch(torch.arange(lo, min(lo + 256, len(dataset))))
        if y.dtype.is_floating_point or y.dim() < 2:
            raise DataError("data.curriculum.score = 'length' needs token samples (text or instruction data); score "
                            "this data by 'loss' or a scores file")
        out.append((y != -100).flatten(1).sum(1).double())
    return torch.cat(out)
