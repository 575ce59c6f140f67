"""data.name = "digit-captions": image-caption pairs made from scikit-learn's digits, for vision-language models.

Each digit is turned by an angle drawn once per sample (-25, 0 or +25 degrees) and captioned from its class, its
ink (bold or thin: above or below the median stroke mass) and its turn:

    "a handwritten seven , bold , rotated left"        "a handwritten zero , thin , upright"

in a word vocabulary of 22 tokens (VOCAB). A sample is one row of floats: the image's 64 pixels in [0, 1], then
the caption's CAPTION_TOKENS - 1 input token ids (<bos> first, <pad> after <eos>); its target is the next token at
each position, -100 on padding (a mean over each row's caption tokens: spec.masked_targets). The class word is
always the third caption token, so the zero-shot classifier (plait.models.vlm.zero_shot_accuracy) scores "a
handwritten <digit>" for each digit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.data.datasets import split_tensors
from plait.data.digits import digits_arrays
from plait.data.spec import SPLIT_SEED, DataBundle, DataSpec

DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
VOCAB = ("<pad>", "<bos>", "<eos>", "a", "handwritten", *DIGITS, ",", "bold", "thin", "upright", "rotated", "left",
         "right")
IDS = {w: i for i, w in enumerate(VOCAB)}
CAPTION_TOKENS = 10  # <bos> a handwritten seven , bold , rotated left <eos>
IMAGE_SHAPE = [1, 8, 8]
CLASS_POSITION = 2  # the target position of the digit's word ("a handwritten" before it)
ANGLES = (-25.0, 0.0, 25.0)


def caption(label: int, bold: bool, turn: int) -> list[str]:
    """The words of a caption (turn: -1 left, 0 upright, 1 right)."""
    how = ["upright"] if turn == 0 else ["rotated", "left" if turn < 0 else "right"]
    return ["a", "handwritten", DIGITS[label], ",", "bold" if bold else "thin", ",", *how]


def encode(words: list[str]) -> torch.Tensor:
    ids = [IDS["<bos>"], *(IDS[w] for w in words), IDS["<eos>"]]
    return torch.tensor(ids + [IDS["<pad>"]] * (CAPTION_TOKENS - len(ids)))


def turned(images: torch.Tensor, degrees: torch.Tensor) -> torch.Tensor:
    """Each image (N, 1, H, W) turned about its centre by its angle (bilinear, zeros outside)."""
    a = torch.deg2rad(degrees)
    theta = torch.stack([torch.stack([a.cos(), -a.sin(), torch.zeros_like(a)], 1),
                         torch.stack([a.sin(), a.cos(), torch.zeros_like(a)], 1)], 1)
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, align_corners=False).clamp(0, 1)


def digit_captions(data_cfg, model_cfg) -> DataBundle:
    images, labels = digits_arrays()
    x = torch.from_numpy(images).float().div(16.0).unsqueeze(1)
    turn = torch.randint(0, 3, (len(x),), generator=torch.Generator().manual_seed(SPLIT_SEED + 7)) - 1
    x = turned(x, torch.tensor(ANGLES)[turn + 1])
    ink = x.flatten(1).sum(1)
    bold = ink > ink.median()
    ids = torch.stack([encode(caption(int(c), bool(b), int(t))) for c, b, t in zip(labels.tolist(), bold, turn)])
    inputs = torch.cat([x.flatten(1), ids[:, :-1].float()], 1)
    targets = ids[:, 1:].masked_fill(ids[:, 1:] == IDS["<pad>"], -100)
    train, val = split_tensors("digit-captions", inputs, targets, data_cfg.val_fraction)
    spec = DataSpec(name="digit-captions", task="lm", input_shape=[inputs.shape[1]], vocab_size=len(VOCAB),
                    tokens_per_sample=CAPTION_TOKENS - 1, masked_targets=True, image_shape=IMAGE_SHAPE)
    return DataBundle(train, val, spec)
