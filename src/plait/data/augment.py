"""Two augmented views of every sample, for contrastive training: seeded per sample and step, never per rank.

    views = TwoViews(bundle.train, seed=1234, shift=1, noise=0.1)
    x, y = views.fetch_at(idx, step)      # x: (batch, 2, *input_shape), the two views of each sample

A view of an image is a random shift by up to `shift` pixels in each spatial direction (the edge
is padded with zeros), then Gaussian noise of std `noise`; a vector input gets the noise only.
Each view's randomness comes from (seed, sample index, step, view), so a sample gets the same
views whichever rank or micro-batch takes it: the trajectory does not depend on the layout.
Validation (`fetch`) uses the fixed step -1, so the validation loss is one number per model.

`data.augment = ["random_crop", "hflip", "noise", "randaugment"]` (supervised training on images; RandAugment:
plait.data.randaugment) uses the same operations through `Augmented`: each sample's randomness comes from (seed,
sample index, epoch), where the epoch is the pass over the data the loader is in at that sample's place in the stream.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from plait.data.randaugment import randaugment
from plait.data.spec import DataSpec
from plait.errors import DataError
from plait.runtime import mix_seed


def shift(x: torch.Tensor, max_shift: int, g: torch.Generator) -> torch.Tensor:
    """Move the image by up to max_shift pixels in each spatial direction; the uncovered edge becomes 0 (in place)."""
    dy, dx = (int(v) for v in torch.randint(-max_shift, max_shift + 1, (2,), generator=g))
    x = torch.roll(x, (dy, dx), dims=(-2, -1))
    if dy > 0:
        x[..., :dy, :] = 0
    elif dy < 0:
        x[..., dy:, :] = 0
    if dx > 0:
        x[..., :dx] = 0
    elif dx < 0:
        x[..., dx:] = 0
    return x


def noise(x: torch.Tensor, std: float, g: torch.Generator) -> torch.Tensor:
    return x + std * torch.randn(x.shape, generator=g)


def hflip(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Mirror left-right with probability 1/2."""
    return x.flip(-1) if bool(torch.rand((), generator=g) < 0.5) else x


def random_crop(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A crop of the image padded by 1/8 of its size with zeros: a shift by up to size / 8 pixels."""
    return shift(x, max(1, x.shape[-1] // 8), g)


AUGMENTS = ("random_crop", "hflip", "noise", "randaugment")


class Augmented:
    """Training-time augmentation of image samples, seeded per (seed, sample index, epoch): layout-independent.

    The loader calls `fetch_epoch(idx, epochs)` with each sample's epoch (its place in the sampler's stream
    divided by the dataset size); validation (`fetch`) is not augmented.
    """

    def __init__(self, dataset, ops: list[str], seed: int, noise_std: float, rand_n: int = 2, rand_magnitude: int = 9):
        self.dataset, self.ops, self.seed, self.noise_std = dataset, list(ops), seed, noise_std
        self.rand_n, self.rand_magnitude = rand_n, rand_magnitude

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name):  # records, image_meta, source_index, skipped, ... of the wrapped dataset
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def augment(self, x: torch.Tensor, index: int, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(mix_seed(self.seed, index, epoch, 0xA06))
        for op in self.ops:
            if op == "random_crop":
                x = random_crop(x, g)
            elif op == "hflip":
                x = hflip(x, g)
            elif op == "noise" and self.noise_std:
                x = noise(x, self.noise_std, g)
            elif op == "randaugment":
                x = randaugment(x, self.rand_n, self.rand_magnitude, g)
        return x

    def fetch_epoch(self, idx: torch.Tensor, epochs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.dataset.fetch(idx)
        x = torch.stack([self.augment(x[k].clone(), int(i), int(e))
                         for k, (i, e) in enumerate(zip(idx.tolist(), epochs.tolist()))])
        return x, y

    def fetch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset.fetch(idx)


def augmented(bundle, data_cfg, seed: int):
    """The bundle with data.augment applied to its training split (images: samples of shape (C, H, W))."""
    if not data_cfg.augment:
        return bundle
    if len(bundle.spec.input_shape) != 3:
        raise DataError(f"data.augment = {data_cfg.augment} transforms images (channels, height, width); data.name = "
                        f"{bundle.spec.name!r} gives samples of shape {tuple(bundle.spec.input_shape)}: set data.augment=[]")
    return replace(bundle, train=Augmented(bundle.train, data_cfg.augment, seed, data_cfg.augment_noise,
                                           data_cfg.randaugment_n, data_cfg.randaugment_magnitude))


class TwoViews:
    """A dataset whose samples are two augmented views of the wrapped dataset's inputs (labels kept for probes)."""

    def __init__(self, dataset, seed: int, shift: int, noise: float):
        self.dataset, self.seed, self.shift, self.noise = dataset, seed, shift, noise

    def __len__(self) -> int:
        return len(self.dataset)

    def _view(self, x: torch.Tensor, index: int, step: int, view: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(mix_seed(self.seed, index, step, view))
        if self.shift and x.dim() >= 2:
            x = shift(x, self.shift, g)
        if self.noise:
            x = noise(x, self.noise, g)
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
