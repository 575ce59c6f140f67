"""Your own data: `data.factory = "package.module:make"` returns a map-style dataset or a (train, val) pair.

    def make(**options):                 # data.options are its keyword arguments
        return MyDataset(...)            # __len__, __getitem__(i) -> (input, target); optional collate(samples)

plait's sampler picks samples by index (seed, step -> indices), so a user's dataset keeps what the
built-in sources have: the same global batches at every layout, and an exact resume. `fetch(idx)`
reads `dataset[i]` for each index and collates them (the dataset's own `collate` when it has one,
else torch's default_collate) into (inputs, targets). A single dataset is split into train and
validation by data.val_fraction with a fixed seed (SPLIT_SEED), as the built-in sources are.

Every rank (and the launcher, to check it before any worker starts) calls the factory itself: it is
imported by name, never pickled.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import default_collate

from plait.data.spec import SPLIT_SEED, DataBundle, DataSpec
from plait.errors import ConfigError, DataError, PlaitError
from plait.refs import import_object  # a user's 'package.module:name' (plait.train.build imports it from here)

CHECKED_SAMPLES = 8  # samples collated before launch, from both ends of each split


def _is_map_style(obj: Any) -> bool:
    return hasattr(type(obj), "__len__") and hasattr(type(obj), "__getitem__")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class MapDataset:
    """A user's map-style dataset (or the samples `keep` of it), read by index: fetch(idx) -> (inputs, targets)."""

    def __init__(self, dataset: Any, where: str, keep: torch.Tensor | None = None):
        self.dataset, self.where, self.keep = dataset, where, keep
        self.collate = getattr(dataset, "collate", None) or default_collate

    def __len__(self) -> int:
        return len(self.keep) if self.keep is not None else len(self.dataset)

    def fetch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.keep[idx].tolist() if self.keep is not None else idx.tolist()
        samples = [self.dataset[i] for i in rows]
        try:
            batch = self.collate(samples)
        except PlaitError:
            raise
        except Exception as e:  # ragged shapes, types default_collate does not know, a user's collate failing
            raise DataError(f"{self.where}: samples {rows[:4]}{' ...' if len(rows) > 4 else ''} do not collate into a "
                            f"batch ({_first_line(e)}); give every sample the same shape and type, or the dataset a "
                            "collate(samples) -> (inputs, targets)") from None
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise DataError(f"{self.where}: a batch must be (inputs, targets), but collating gave "
                            f"{type(batch).__name__}; make __getitem__ return an (input, target) pair")
        x, y = (torch.as_tensor(v) for v in batch)
        # Python floats collate to float64; the models and losses work in float32.
        return (x.float() if x.dtype == torch.float64 else x), (y.float() if y.dtype == torch.float64 else y)


def _split(dataset: Any, val_fraction: float, ref: str) -> tuple[MapDataset, MapDataset]:
    n = len(dataset)
    n_val = max(1, int(n * val_fraction))
    if n_val >= n:
        raise DataError(f"data.factory = {ref!r} gave {n} sample(s): too few to hold out a validation set; return more "
                        "samples or a (train, val) pair")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    return (MapDataset(dataset, f"data.factory = {ref!r} (train split)", perm[n_val:]),
            MapDataset(dataset, f"data.factory = {ref!r} (validation split)", perm[:n_val]))


def _check(ds: MapDataset) -> tuple[torch.Tensor, torch.Tensor]:
    """Collate a few samples from both ends (bad input named before any worker starts); returns that batch."""
    n = len(ds)
    if n == 0:
        raise DataError(f"{ds.where} is empty; return a dataset with samples")
    first = ds.dataset[ds.keep[0].item() if ds.keep is not None else 0]
    own_collate = getattr(ds.dataset, "collate", None) is not None  # it makes (inputs, targets) of its own samples
    if not own_collate and (not isinstance(first, (tuple, list)) or len(first) != 2):
        raise DataError(f"{ds.where}: a sample is {type(first).__name__}, not an (input, target) pair; make "
                        "__getitem__ return (input, target)")
    half = CHECKED_SAMPLES // 2
    idx = sorted(set(range(min(half, n))) | set(range(max(0, n - half), n)))
    return ds.fetch(torch.tensor(idx))


def _labels(ds: MapDataset, chunk: int = 256) -> torch.Tensor:
    return torch.cat([ds.fetch(torch.arange(i, min(i + chunk, len(ds))))[1].reshape(-1) for i in range(0, len(ds), chunk)])


def factory_spec(train: MapDataset, val: MapDataset, task: str) -> DataSpec:
    """The DataSpec of a user's data, from a batch of it: input shape, classification or regression, output width.

    Classification needs the number of classes: the dataset's `num_classes` attribute, else the length of its
    `classes` (torchvision's datasets), else the largest label + 1 over both splits (one pass over the samples).
    """
    x, y = _check(train)
    _check(val)
    if task == "auto":
        task = "regression" if y.is_floating_point() else "classification"
    if task == "classification":
        if y.is_floating_point() or y.dim() != 1:
            raise DataError(f"{train.where}: classification needs one integer class index per sample; the targets are "
                            f"{y.dtype} of shape {tuple(y.shape[1:])} per sample: return integer labels or set "
                            "data.task='regression'")
        classes = getattr(train.dataset, "num_classes", None)
        names = getattr(train.dataset, "classes", None)  # torchvision's datasets: the class names
        if classes is None and isinstance(names, (list, tuple)) and names:
            classes = len(names)
        if classes is None:
            labels = torch.cat([_labels(train), _labels(val)])
            if int(labels.min()) < 0:
                raise DataError(f"{train.where}: class labels must be >= 0; found {int(labels.min())}")
            classes = int(labels.max()) + 1
        return DataSpec(name="factory", task="classification", input_shape=list(x.shape[1:]), num_classes=int(classes))
    outputs = 1 if y.dim() == 1 else int(torch.tensor(y.shape[1:]).prod())
    return DataSpec(name="factory", task="regression", input_shape=list(x.shape[1:]), num_classes=outputs)


def factory_source(data_cfg, model_cfg) -> Any:
    """data.factory: the user's dataset(s) as a DataBundle."""
    ref = data_cfg.factory
    made = import_object("data.factory", ref)(**data_cfg.options)
    parts = made if isinstance(made, tuple) and len(made) == 2 else (made,)  # (train, val), or one to split
    for part in parts:
        if not _is_map_style(part):
            iterable = isinstance(part, torch.utils.data.IterableDataset)
            raise ConfigError(f"data.factory = {ref!r} returned {type(part).__name__}, which has no "
                              f"{'__len__' if hasattr(type(part), '__getitem__') else '__len__ / __getitem__'}"
                              f"{' (an iterable dataset)' if iterable else ''}: plait's sampler picks samples by index; "
                              "return a map-style dataset (or a (train, val) pair of them)")
    if len(parts) == 2:
        train, val = (MapDataset(p, f"data.factory = {ref!r} ({s} split)") for p, s in zip(parts, ("train", "validation")))
    else:
        train, val = _split(parts[0], data_cfg.val_fraction, ref)
    return DataBundle(train, val, factory_spec(train, val, data_cfg.task))
