"""Patch gradient descent (Gupta et al. 2023, "Patch Gradient Descent: Training Neural Networks on Very Large
Images"): the CNN's blocks see one patch at a time, and a step back-propagates through only a few patches.

    model.name = "cnn", model.patch_size = 32, model.patch_grad = 2

The image (C, H, W) is cut into a grid of patch_size x patch_size patches. The backbone (the CNN's convolution
blocks, then a mean over the patch) maps each patch to a vector; together they form the latent Z, a
(width, H / patch, W / patch) grid, which the head (a 3 x 3 convolution block over Z, a mean, a linear layer)
classifies. In training, Z is first filled patch by patch without gradients (no activation is kept), then
`patch_grad` patches, the same for the whole step, are run again with gradients and written into Z: activation
memory is that of patch_grad patches plus the head, whatever the image size. Evaluation fills Z whole, without
gradients. This is PatchGD with one inner iteration per step (the paper accumulates several).

The patches of step s are drawn from (train.seed, s) (plait.train.callbacks.PatchSteps sets the step): every
rank and micro-batch of the step draws the same, so the trajectory does not depend on the layout.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from plait.runtime import mix_seed


class PatchCNN(nn.Module):
    def __init__(self, in_channels: int, width: int, depth: int, classes: int, patch: int, grad_patches: int,
                 dropout: float = 0.0):
        super().__init__()
        chans = [in_channels] + [width] * depth
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.GroupNorm(1, b), nn.ReLU())
            for a, b in zip(chans[:-1], chans[1:])
        )
        self.mix = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.GroupNorm(1, width), nn.ReLU())
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(width, classes)
        self.patch, self.grad_patches = patch, grad_patches
        self.seed, self.step = 0, 0  # PatchSteps sets them before every step

    def encode(self, patches: torch.Tensor) -> torch.Tensor:
        """(N, C, p, p) patches -> (N, width) vectors."""
        for block in self.blocks:
            patches = block(patches)
        return patches.mean(dim=(2, 3))

    def chosen(self, count: int) -> torch.Tensor:
        """The patches that get gradients at this step: grad_patches of count, from (seed, step)."""
        g = torch.Generator().manual_seed(mix_seed(self.seed, self.step, 0))
        return torch.randperm(count, generator=g)[:self.grad_patches].sort().values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        p = self.patch
        gh, gw = h // p, w // p
        patches = x.reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c, p, p)
        n = gh * gw
        if self.training and self.grad_patches < n:
            with torch.no_grad():  # the latent, one patch at a time: nothing saved for backward
                z = torch.stack([self.encode(patches[:, i]) for i in range(n)], 1)
            idx = self.chosen(n).to(x.device)
            fresh = self.encode(patches[:, idx].reshape(b * len(idx), c, p, p)).reshape(b, len(idx), -1)
            z = z.index_copy(1, idx, fresh)  # the chosen patches' vectors, with their gradients
        elif self.training:
            z = self.encode(patches.reshape(b * n, c, p, p)).reshape(b, n, -1)
        else:
            with torch.no_grad():
                z = torch.stack([self.encode(patches[:, i]) for i in range(n)], 1)
        z = z.transpose(1, 2).reshape(b, -1, gh, gw)
        return self.head(self.drop(self.mix(z).mean(dim=(2, 3))))
