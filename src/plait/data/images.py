"""Image folders: `data.name = "images"`, `data.path = DIR` with one sub-folder per class.

    DIR/cat/001.jpg, DIR/cat/002.png, DIR/dog/...      -> classes ["cat", "dog"] (sorted), labels 0, 1

Images are decoded with Pillow when a batch is fetched (in the loader's worker processes when
`data.workers` > 0), converted to RGB, resized to `data.image_size` squared and scaled to [0, 1]:
samples of shape (3, S, S). A file that does not decode is an error naming it, or, with
`data.on_bad_sample = "skip"`, replaced by the next sample (in index order) that decodes, and counted:
the replacement depends only on the index, so the batch stays the same at every layout.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import numpy as np
import torch

from plait.data.spec import SPLIT_SEED, DataBundle, DataSpec
from plait.errors import DataError

SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
log = logging.getLogger("plait.data")


def list_images(root: Path) -> tuple[list[str], list[Path], list[int]]:
    """Class names, image files and labels of a folder with one sub-folder per class (hidden entries skipped)."""
    if not root.is_dir():
        raise DataError(f"data.path = {str(root)!r} is not a folder; point it at a folder with one sub-folder per class")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if len(classes) < 2:
        raise DataError(f"data.path = {str(root)!r} has {len(classes)} class folder(s); an image folder needs one "
                        "sub-folder per class, at least two")
    files, labels = [], []
    for label, name in enumerate(classes):
        found = sorted(p for p in (root / name).rglob("*")
                       if p.is_file() and p.suffix.lower() in SUFFIXES
                       and not any(part.startswith(".") for part in p.relative_to(root).parts))
        if not found:
            raise DataError(f"class folder {root / name} has no images ({', '.join(SUFFIXES)}); add images or remove "
                            "the folder")
        files += found
        labels += [label] * len(found)
    return classes, files, labels


def decode(data: bytes, size: int) -> torch.Tensor:
    """Encoded image bytes -> (3, size, size) float in [0, 1]."""
    from PIL import Image  # lazily: only image data needs Pillow

    with Image.open(io.BytesIO(data)) as im:
        im = im.convert("RGB")
        if im.size != (size, size):
            im = im.resize((size, size), Image.BILINEAR)
        arr = np.asarray(im, dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(255.0)


class _Decoding:
    """fetch() for datasets of encoded images: decode each, apply the bad-sample policy."""

    size: int
    on_bad: str

    def __len__(self) -> int:
        raise NotImplementedError

    def _encoded(self, i: int) -> tuple[bytes, int]:
        raise NotImplementedError

    def _where(self, i: int) -> str:
        raise NotImplementedError

    def _sample(self, i: int) -> tuple[torch.Tensor, int]:
        n = len(self)
        for k in range(n):
            j = (i + k) % n
            try:
                data, label = self._encoded(j)
                return decode(data, self.size), label
            except DataError:
                raise
            except Exception as e:  # Pillow raises several types for undecodable input
                if self.on_bad != "skip":
                    raise DataError(f"{self._where(j)} cannot be decoded as an image ({type(e).__name__}: {e}); fix or "
                                    "remove the file, or set data.on_bad_sample='skip'") from None
                self.skipped = getattr(self, "skipped", 0) + 1
                log.warning("skipped undecodable image %s (%d skipped so far)", self._where(j), self.skipped)
        raise DataError(f"no sample of {self._where(0)} ... decodes; check the data")

    def fetch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self._sample(i) for i in idx.tolist()]
        return torch.stack([r[0] for r in rows]), torch.tensor([r[1] for r in rows], dtype=torch.long)


class ImageFiles(_Decoding):
    """Images read from their files when fetched."""

    def __init__(self, root: Path, files: list[Path], labels: list[int], size: int, on_bad: str,
                 source_index: torch.Tensor, classes: list[str]):
        self.root, self.files, self.labels, self.size, self.on_bad = root, files, labels, size, on_bad
        self.source_index, self.classes, self.skipped = source_index, classes, 0

    def __len__(self) -> int:
        return len(self.files)

    def _encoded(self, i: int) -> tuple[bytes, int]:
        try:
            return self.files[i].read_bytes(), self.labels[i]
        except OSError as e:
            raise DataError(f"{self.files[i]} cannot be read ({e}); restore it or remove it from {self.root}") from None

    def _where(self, i: int) -> str:
        return str(self.files[i])

    def records(self, i: int) -> tuple[bytes, int]:
        """The encoded file and label of sample i (what `plait data pack` stores)."""
        return self._encoded(i)

    @property
    def image_meta(self) -> dict:
        return {"size": self.size, "classes": self.classes,
                "paths": [str(f.relative_to(self.root)) for f in self.files],
                "source_index": self.source_index.tolist()}


class PackedImages(_Decoding):
    """A packed split of encoded images (plait.data.packed.PackedSplit), decoded when fetched."""

    def __init__(self, split, meta: dict, on_bad: str = "error"):
        self.split, self.size, self.on_bad, self.skipped = split, int(meta["size"]), on_bad, 0
        self.classes = meta["classes"]

    def __len__(self) -> int:
        return len(self.split)

    def _encoded(self, i: int) -> tuple[bytes, int]:
        r = self.split.raw(i)
        return r["image"], int(np.asarray(r["y"]).reshape(-1)[0])

    def _where(self, i: int) -> str:
        return f"sample {i} of {self.split.path}"

    def records(self, i: int) -> tuple[bytes, int]:
        return self._encoded(i)


def image_folder(data_cfg, model_cfg):
    """data.name = "images": train and validation splits of a folder of class folders (split by a fixed seed)."""
    root = Path(data_cfg.path)
    classes, files, labels = list_images(root)
    n = len(files)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_val = max(1, int(n * data_cfg.val_fraction))
    if n_val >= n:
        raise DataError(f"data.path = {str(root)!r} has only {n} images: too few to hold out a validation set")
    parts = []
    for ids in (perm[n_val:], perm[:n_val]):
        ids = ids.sort().values  # each split in file order
        parts.append(ImageFiles(root, [files[i] for i in ids], [labels[i] for i in ids], data_cfg.image_size,
                                data_cfg.on_bad_sample, ids, classes))
    s = data_cfg.image_size
    spec = DataSpec(name="images", task="classification", input_shape=[3, s, s], num_classes=len(classes))
    return DataBundle(parts[0], parts[1], spec)
