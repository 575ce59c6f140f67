"""data.augment = ["randaugment"]: RandAugment (Cubuk et al. 2020) on image tensors, in plain torch.

Each sample (seeded per (seed, sample index, epoch), like the other augmentations) gets `data.randaugment_n`
operations drawn uniformly from OPS, each at the one global magnitude `data.randaugment_magnitude` (0-10; m =
magnitude / 10), with a random sign where the operation has one:

    rotate      +-30 m degrees                    shear_x, shear_y    +-0.3 m
    translate_x, translate_y  +-0.3 m of the size brightness          x (1 +- 0.9 m)
    contrast    mean + (x - mean)(1 +- 0.9 m)      solarize            pixels above max (1 - m) become max - x
    identity

Geometric operations resample the image bilinearly with zeros outside it. Magnitude 0 changes nothing, so the
magnitude is one number to search: `plait tune --space` with `data.randaugment_magnitude = {int = [0, 10]}`
(RandAugment's point: one magnitude and one count instead of a learned policy).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

OPS = ("identity", "rotate", "shear_x", "shear_y", "translate_x", "translate_y", "brightness", "contrast", "solarize")


def _affine(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """x (C, H, W) resampled through the 2 x 3 matrix theta (normalised coordinates), zeros outside."""
    grid = F.affine_grid(theta[None], [1, *x.shape], align_corners=False)
    return F.grid_sample(x[None].float(), grid, mode="bilinear", padding_mode="zeros", align_corners=False)[0].to(x.dtype)


def apply(op: str, x: torch.Tensor, m: float, sign: float) -> torch.Tensor:
    """One operation at magnitude m in [0, 1] with sign +-1."""
    if op == "identity" or m == 0:
        return x
    if op == "rotate":
        a = math.radians(30 * m * sign)
        return _affine(x, torch.tensor([[math.cos(a), -math.sin(a), 0.0], [math.sin(a), math.cos(a), 0.0]]))
    if op in ("shear_x", "shear_y"):
        s = 0.3 * m * sign
        theta = [[1.0, s, 0.0], [0.0, 1.0, 0.0]] if op == "shear_x" else [[1.0, 0.0, 0.0], [s, 1.0, 0.0]]
        return _affine(x, torch.tensor(theta))
    if op in ("translate_x", "translate_y"):
        t = 2 * 0.3 * m * sign  # normalised coordinates span 2
        theta = [[1.0, 0.0, t], [0.0, 1.0, 0.0]] if op == "translate_x" else [[1.0, 0.0, 0.0], [0.0, 1.0, t]]
        return _affine(x, torch.tensor(theta))
    if op == "brightness":
        return x * (1 + 0.9 * m * sign)
    if op == "contrast":
        mean = x.mean()
        return mean + (x - mean) * (1 + 0.9 * m * sign)
    if op == "solarize":
        top = x.max()
        return torch.where(x > top * (1 - m), top - x, x)
    raise ValueError(f"unknown RandAugment operation {op!r}")


def randaugment(x: torch.Tensor, n: int, magnitude: int, g: torch.Generator) -> torch.Tensor:
    m = magnitude / 10
    for _ in range(n):
        op = OPS[int(torch.randint(len(OPS), (), generator=g))]
        sign = 1.0 if bool(torch.rand((), generator=g) < 0.5) else -1.0
        x = apply(op, x, m, sign)
    return x
