"""data.name = "large-digits" (plait.data.sources.large_digits): scikit-learn's 8x8 digits, enlarged and placed at
random on a large canvas.

Each digit is scaled up data.digit_scale times (nearest neighbour: 8 x scale pixels a side) and pasted at a position
drawn once per sample (from the split seed) on a black data.canvas_size x data.canvas_size canvas, one channel,
values in [0, 1]. The images are made when a batch is fetched, not held: 1797 canvases of 256 x 256 would take
471 MB as floats. A task for patch gradient descent (plait.models.patchgd): the digit covers a small part of the
image and may straddle patches.
"""

from __future__ import annotations

import torch


class PlacedDigits:
    """Digits (N, 8, 8) in [0, 1] placed at (top, left) on a canvas of `size` pixels, scaled `scale` times."""

    def __init__(self, small: torch.Tensor, y: torch.Tensor, at: torch.Tensor, size: int, scale: int):
        self.small, self.y, self.at, self.size, self.scale = small, y, at, size, scale

    def __len__(self) -> int:
        return len(self.y)

    def fetch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        side = 8 * self.scale
        digits = self.small[idx].repeat_interleave(self.scale, 1).repeat_interleave(self.scale, 2)
        canvas = torch.zeros(len(idx), 1, self.size, self.size)
        for row, (top, left) in enumerate(self.at[idx].tolist()):
            canvas[row, 0, top:top + side, left:left + side] = digits[row]
        return canvas, self.y[idx]

    def subset(self, rows: torch.Tensor) -> PlacedDigits:
        return PlacedDigits(self.small[rows], self.y[rows], self.at[rows], self.size, self.scale)
