"""Checkpoint tensors read on demand, so that a rank reads only the slices it holds.

    src = open_weights(Path("llama-dir"), where)   # {name: Lazy}: headers read, no tensor data
    w = src["model.layers.0.mlp.down_proj.weight"].t()
    w.shape                                        # (in, out): the transposed shape, nothing read
    w.read((slice(0, 4), slice(0, 8)))             # reads those 8 rows x 4 columns of the stored tensor only
    w.full()                                       # the whole tensor

A stored tensor is read through safetensors' `get_slice` from a file opened for that read alone
(its memory map is gone once the slice is copied out), so a rank's resident memory while loading is
its own shards plus the slice in flight. The mapping of a Hugging Face checkpoint to plait's names
(plait.models.hf, plait.models.hf_llama) is written with these views (`t`, `rows`, `chunk`, `stack`,
`pad_rows`), and the whole-model load is the same mapping read with `full()`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from plait.errors import ConfigError

Index = tuple[slice, ...]  # one slice(start, stop) per dimension, start <= stop, step 1

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def whole(shape) -> Index:
    return tuple(slice(0, s) for s in shape)


class Lazy:
    """A tensor of `shape` and `dtype` whose parts are read when asked for."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def read(self, index: Index) -> torch.Tensor:
        raise NotImplementedError

    def full(self) -> torch.Tensor:
        return self.read(whole(self.shape))

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty(0, dtype=self.dtype).element_size()

    def t(self) -> Lazy:
        return Transposed(self)

    def rows(self, start: int, stop: int) -> Lazy:
        return Rows(self, start, min(stop, self.shape[0]))

    def chunk(self, n: int) -> list[Lazy]:
        """n equal parts along the first dimension (torch.chunk of a length n divides)."""
        size = self.shape[0] // n
        return [Rows(self, i * size, (i + 1) * size) for i in range(n)]

    def pad_rows(self, rows: int) -> Lazy:
        """The first dimension zero-padded to `rows` (a padded vocabulary: rows no token looks up, no logit shows)."""
        return self if rows == self.shape[0] else Padded(self, rows)


class Stored(Lazy):
    """A tensor of a safetensors file."""

    def __init__(self, path: Path, name: str, shape, dtype: torch.dtype):
        self.path, self.name, self.shape, self.dtype = path, name, tuple(shape), dtype

    def read(self, index: Index) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:
            if not self.shape:
                return f.get_tensor(self.name)
            if any(s.start == s.stop for s in index):
                return torch.empty([s.stop - s.start for s in index], dtype=self.dtype)
            return f.get_slice(self.name)[index]


class Loaded(Lazy):
    """A tensor already in memory (pytorch_model.bin, which cannot be read in parts)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.shape, self.dtype = tensor, tuple(tensor.shape), tensor.dtype

    def read(self, index: Index) -> torch.Tensor:
        return self.tensor[index]


class Transposed(Lazy):
    def __init__(self, src: Lazy):
        if len(src.shape) != 2:
            raise ValueError(f"only a 2-D tensor transposes, not shape {list(src.shape)}")
        self.src, self.shape, self.dtype = src, src.shape[::-1], src.dtype

    def read(self, index: Index) -> torch.Tensor:
        return self.src.read(index[::-1]).t()


class Rows(Lazy):
    def __init__(self, src: Lazy, start: int, stop: int):
        self.src, self.start = src, start
        self.shape, self.dtype = (stop - start, *src.shape[1:]), src.dtype

    def read(self, index: Index) -> torch.Tensor:
        first = index[0]
        return self.src.read((slice(self.start + first.start, self.start + first.stop), *index[1:]))


class Stacked(Lazy):
    """torch.stack of equal-shaped parts along a new first dimension."""

    def __init__(self, parts: list[Lazy]):
        if len({p.shape for p in parts}) != 1:
            raise ValueError(f"stacked tensors differ in shape: {sorted({p.shape for p in parts})}")
        self.parts, self.shape, self.dtype = parts, (len(parts), *parts[0].shape), parts[0].dtype

    def read(self, index: Index) -> torch.Tensor:
        chosen = self.parts[index[0]]
        if not chosen:
            return torch.empty([s.stop - s.start for s in index], dtype=self.dtype)
        return torch.stack([p.read(index[1:]) for p in chosen])


class Padded(Lazy):
    def __init__(self, src: Lazy, rows: int):
        self.src, self.shape, self.dtype = src, (rows, *src.shape[1:]), src.dtype

    def read(self, index: Index) -> torch.Tensor:
        first, have = index[0], self.src.shape[0]
        real = self.src.read((slice(min(first.start, have), min(first.stop, have)), *index[1:]))
        pad = max(0, first.stop - max(first.start, have))
        if not pad:
            return real
        return torch.cat([real, torch.zeros(pad, *real.shape[1:], dtype=real.dtype)])


def stack(parts: list[Lazy]) -> Lazy:
    return Stacked(parts)


def safetensors_file(path: Path, where: str) -> dict[str, Lazy]:
    """{name: Stored} of one safetensors file, from its header alone."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = Stored(path, name, sl.get_shape(), DTYPES[sl.get_dtype()])
            return out
    except Exception as e:  # noqa: BLE001 -- a damaged or foreign file: say which
        raise ConfigError(f"{where}: {path.name} is not a readable safetensors file ({type(e).__name__}: {e})") from None


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def shard_files(path: Path, where: str) -> list[Path]:
    """The shards model.safetensors.index.json names, each a file inside `path` (no absolute path, no way out)."""
    index = path / "model.safetensors.index.json"
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{where}: model.safetensors.index.json is not an index of shards ({type(e).__name__}); "
                          "it must be a JSON object whose weight_map maps tensor names to shard files") from None
    root = path.resolve()
    shards = []
    for name in names:
        shard = (path / str(name)).resolve()
        if not isinstance(name, str) or Path(name).is_absolute() or root not in shard.parents:
            raise ConfigError(f"{where}: model.safetensors.index.json names the shard {name!r}, outside the directory; "
                              "shards must be files next to the index")
        shards.append(shard)
    return shards


def confined(path: Path, name: str, where: str) -> Path:
    """path / name, which must resolve inside `path`: a link out of a model directory is refused, never followed."""
    f = path / name
    if f.exists() and path.resolve() not in f.resolve().parents:
        raise ConfigError(f"{where}: {name} is a link to a file outside the directory ({f.resolve()}); a model "
                          "directory's files must be its own: copy the file in")
    return f


def open_weights(path: Path, where: str) -> dict[str, Lazy]:
    """{name: Lazy} of a Hugging Face directory's weights (one file, shards with an index, or pytorch_model.bin)."""
    for name in WEIGHT_FILES:
        confined(path, name, where)
    if (path / "model.safetensors").is_file():
        return safetensors_file(path / "model.safetensors", where)
    if (path / "model.safetensors.index.json").is_file():
        out: dict[str, Lazy] = {}
        for shard in shard_files(path, where):
            out.update(safetensors_file(shard, where))
        return out
    if (path / "pytorch_model.bin").is_file():
        try:  # weights_only: tensors and plain containers, never code
            state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 -- torch's unpickler refuses in several exception types
            raise ConfigError(f"{where}: pytorch_model.bin is not a plain state dict torch loads without running code "
                              f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}); convert it to "
                              "model.safetensors") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ConfigError(f"{where}: pytorch_model.bin does not hold a state dict of tensors")
        return {k: Loaded(v) for k, v in state.items()}
    raise ConfigError(f"{where} has no weights: expected one of {', '.join(WEIGHT_FILES)}")
