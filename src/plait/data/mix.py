"""data.mix: synthetic training samples by mixup (Zhang et al. 2018) or cutmix (Yun et al. 2019), seeded per sample.

Each training sample i, in epoch e, is mixed with a partner j and a weight lam ~ Beta(alpha, alpha), both drawn
from (seed, i, e) alone, so a sample is mixed the same way whichever rank or micro-batch takes it:

    mixup    x = lam x_i + (1 - lam) x_j
    cutmix   x = x_i with a box of x_j pasted in (area (1 - lam) of the image, clipped at the edges; lam is then
             the share of x_i actually left)

and the target is the soft label lam onehot(y_i) + (1 - lam) onehot(y_j), which the classification loss takes
as class probabilities (cross-entropy with soft targets, still a mean over samples). Validation is not mixed.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from plait.errors import DataError
from plait.runtime import mix_seed

MIXES = ("none", "mixup", "cutmix")


class Mixed:
    def __init__(self, dataset, kind: str, alpha: float, classes: int, seed: int):
        self.dataset, self.kind, self.alpha, self.classes, self.seed = dataset, kind, alpha, classes, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name):  # the wrapped dataset's records, labels, ...
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def draw(self, index: int, epoch: int) -> tuple[int, float, tuple[float, float]]:
        """(partner, lam, (box centre y, x) as fractions of the image) of sample `index` in `epoch`."""
        rng = np.random.default_rng(mix_seed(self.seed, index, epoch, 0x313))
        return int(rng.integers(len(self.dataset))), float(rng.beta(self.alpha, self.alpha)), tuple(rng.random(2))

    def fetch_epoch(self, idx: torch.Tensor, epochs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inner = getattr(self.dataset, "fetch_epoch", None)
        x, y = inner(idx, epochs) if inner is not None else self.dataset.fetch(idx)
        draws = [self.draw(int(i), int(e)) for i, e in zip(idx.tolist(), epochs.tolist())]
        xj, yj = self.dataset.fetch(torch.tensor([d[0] for d in draws], dtype=torch.long))
        lam = torch.tensor([d[1] for d in draws], dtype=torch.float32)
        x = x.float().clone()
        if self.kind == "mixup":
            shape = (-1,) + (1,) * (x.dim() - 1)
            x = lam.view(shape) * x + (1 - lam.view(shape)) * xj.float()
        else:
            h, w = x.shape[-2:]
            for k, (_, share, (cy, cx)) in enumerate(draws):
                bh, bw = round(h * (1 - share) ** 0.5), round(w * (1 - share) ** 0.5)
                y0, x0 = int(cy * h) - bh // 2, int(cx * w) - bw // 2
                y0, y1, x0, x1 = max(0, y0), min(h, y0 + bh), max(0, x0), min(w, x0 + bw)
                x[k, ..., y0:y1, x0:x1] = xj[k, ..., y0:y1, x0:x1].float()
                lam[k] = 1 - (y1 - y0) * (x1 - x0) / (h * w)
        lam = lam[:, None]
        soft = lam * F.one_hot(y.long(), self.classes).float() + (1 - lam) * F.one_hot(yj.long(), self.classes).float()
        return x, soft

    def fetch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset.fetch(idx)


def mixed(bundle, data_cfg, seed: int):
    """The bundle with data.mix applied to its training split (classification; cutmix: images)."""
    if data_cfg.mix == "none":
        return bundle
    spec = bundle.spec
    if spec.task != "classification" or spec.class_weights:
        raise DataError(f"data.mix = {data_cfg.mix!r} mixes the labels of a classification task without class weights; "
                        f"this data's task is {spec.task!r}: set data.mix='none'")
    if data_cfg.mix == "cutmix" and len(spec.input_shape) != 3:
        raise DataError(f"data.mix = 'cutmix' pastes boxes between images (channels, height, width); these samples "
                        f"have shape {tuple(spec.input_shape)}: use data.mix='mixup'")
    return replace(bundle, train=Mixed(bundle.train, data_cfg.mix, data_cfg.mix_alpha, spec.num_classes, seed))
