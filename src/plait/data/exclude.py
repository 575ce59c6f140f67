"""data.exclude = "DIR/audit.json": train without the samples a `plait data audit` flagged.

The audit names samples by their index in the source (the row of a tensors file, the sample of
digits, the file of an image folder, in the source's own order); `audit.json["exclude"]` lists the
ones to leave out (label issues and the later copies of duplicates; edit the list to choose).
Only the training split shrinks: validation stays the same set, so runs with and without the
exclusion are measured on the same samples.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from plait.errors import DataError


class Subset:
    """The samples `keep` (positions) of a dataset, renumbered 0..len(keep)-1."""

    def __init__(self, dataset, keep: torch.Tensor):
        self.dataset, self.keep = dataset, keep
        src = getattr(dataset, "source_index", None)
        self.source_index = src[keep] if src is not None else None

    def __len__(self) -> int:
        return len(self.keep)

    def fetch(self, idx: torch.Tensor):
        return self.dataset.fetch(self.keep[idx])


def read_exclusions(path: str | Path) -> set[int]:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data.exclude = {str(p)!r} does not exist; point it at the audit.json `plait data audit` wrote")
    try:
        ids = json.loads(p.read_text())["exclude"]
        return {int(i) for i in ids}
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"data.exclude = {str(p)!r} is not an audit.json with an 'exclude' list of sample indices ({e})") from None


def exclude(bundle, path: str | Path):
    """The bundle without the training samples listed in audit.json's "exclude"."""
    drop = read_exclusions(path)
    src = getattr(bundle.train, "source_index", None)
    if src is None:
        raise DataError(f"data.exclude: data.name = {bundle.spec.name!r} does not name its samples by source index "
                        "(text and packed text data); use it with digits, synthetic, tensors, images or their packed forms")
    mask = torch.tensor([int(i) not in drop for i in src.tolist()], dtype=torch.bool)
    if not bool(mask.any()):
        raise DataError(f"data.exclude = {str(path)!r} leaves no training samples")
    return replace(bundle, train=Subset(bundle.train, mask.nonzero().flatten()))
