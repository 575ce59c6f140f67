"""Two augmented views of every sample, for contrastive training: seeded per sample and step, never per rank.

    views = TwoViews(bundle.train, seed=1234, shift=1, noise=0.1)
    x, y = views.fetch_at(idx, step)      # x: (batch, 2, *input_shape), the two views of each sample

A view of an image is a random shift by up to `shift` pixels in each spatial direction (the edge
is padded with zeros), then Gaussian noise of std `noise`; a vector input gets the noise only.
Each view's randomness comes from (seed, sample index, step, view), so a sample gets the same
views whichever rank or micro-batch takes it: the trajectory does not depend on the layout.
Validation (`fetch`) uses the fixed step -1, so the validation loss is one number per model.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from plait.data.spec import DataSpec
from plait.runtime import mix_seed


class TwoViews:
    """A dataset whose samples are two augmented views of the wrapped dataset's inputs (labels kept for probes)."""

    def __init__(self, dataset, seed: int, shift: int, noise: float):
        self.dataset, self.seed, self.shift, self.noise = dataset, seed, shift, noise

    def __len__(self) -> int:
        return len(self.dataset)

    def _view(self, x: torch.Tensor, index: int, step: int, view: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(mix_seed(self.seed, index, step, view))
        if self.shift and x.dim() >= 2:
            dy, dx = (int(v) for v in torch.randint(-self.shift, self.shift + 1, (2,), generator=g))
            x = torch.roll(x, (dy, dx), dims=(-2, -1))
            if dy > 0:
                x[..., :dy, :] = 0
            elif dy < 0:
                x[..., dy:, :] = 0
            if dx > 0:
                x[..., :dx] = 0
            elif dx < 0:
                x[..., dx:] = 0
        if self.noise:
            x = x + self.noise * torch.randn(x.shape, generator=g)
        return x

    def fetch_at(self, idx: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The views of samples `idx` as drawn at training step `step`: (batch, 2, *input_shape), labels."""
        x, y = self.dataset.fetch(idx)
        views = [torch.stack([self._view(x[k].clone(), int(i), step, v) for v in (0, 1)])
                 for k, i in enumerate(idx.tolist())]
        return torch.stack(views), y

    def fetch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fetch_at(idx, -1)


def two_views(bundle, data_cfg, seed: int):
    """The bundle for contrastive training: both splits give two views per sample; the task becomes "contrastive"."""
    wrap = lambda d: TwoViews(d, seed, data_cfg.augment_shift, data_cfg.augment_noise)  # noqa: E731
    spec: DataSpec = replace(bundle.spec, task="contrastive")
    return replace(bundle, train=wrap(bundle.train), val=wrap(bundle.val), spec=spec)
