"""Packed datasets: any plait source written once as compressed shards, then read by index without loading it whole.

    pack(bundle, "packed/digits", shard_bytes=64 << 20)      # plait data pack digits -o packed/digits
    bundle = packed_source(data_cfg, model_cfg)               # data.name = "packed", data.path = "packed/digits"

The shard format and the reading are LitData's (`litdata.streaming`): its `BinaryWriter` writes
zstd-compressed chunks (one zstd frame per sample, so a random read inflates one sample) and an
`index.json`; its `StreamingDataset` opens chunks on demand (memory-mapped, released as it moves
on, so resident memory stays bounded whatever the dataset's size).
plait does not use LitData's own shuffling or its distributed sampler: sample i of a packed split is
sample i of the source, and plait's `GlobalBatchSampler` still decides the order, so the global
batch at step s is a function of (seed, s) only and a packed dataset trains to the weights of the
same data in memory, at any world size.

Layout of DIR: `plait.json` (what the data is: the source's DataSpec, the tokenizer, the sizes),
`train/` and `val/` (LitData datasets: `index.json` + `chunk-*.bin`). Samples hold numpy arrays
only (`x`, `y`) or, for image folders, the encoded file bytes; a shard whose index declares
any other field format (LitData's `pickle`, `X:pickle`, `graph`, media decoders), item loader, encryption or
pytree type is refused before LitData opens a shard, so reading a packed dataset never unpickles.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from plait.data.hf_tokenizer import tokenizer_from_json
from plait.data.images import PackedImages
from plait.data.packmeta import FORMAT, is_remote, read_meta
from plait.data.packmeta import source_name as source_name  # re-exported, as it was
from plait.data.spec import DataBundle, DataSpec
from plait.errors import DataError
from plait.files import json_objects

SPLITS = ("train", "val")


def parse_size(text: str | int) -> int:
    """'64MB', '512KB', '1GB' or a number of bytes -> bytes."""
    if isinstance(text, int):
        return text
    t = str(text).strip().upper().replace(" ", "")
    units = {"GB": 1 << 30, "MB": 1 << 20, "KB": 1 << 10, "B": 1}
    for unit, mult in units.items():
        if t.endswith(unit):
            try:
                return int(float(t[: -len(unit)]) * mult)
            except ValueError:
                break
    try:
        return int(t)
    except ValueError:
        raise DataError(f"--shard-size {text!r} is not a size; write e.g. 64MB, 512KB or a number of bytes") from None


def _writer(out: Path, shard_bytes: int):
    from litdata.streaming.writer import BinaryWriter  # lazily: only packing and packed reading need LitData

    return BinaryWriter(str(out), chunk_bytes=shard_bytes, compression="zstd", compression_level="sample")


def _write_split(dataset, out: Path, shard_bytes: int, batch: int = 256) -> tuple[int, list]:
    """Write every sample of `dataset` (its `fetch` order) into a LitData dataset at `out`; the count and the labels
    (classification: one int per sample, kept in plait.json for balanced sampling)."""
    out.mkdir(parents=True)
    w = _writer(out, shard_bytes)
    records = getattr(dataset, "records", None)  # image folders: the encoded file bytes, decoded when read
    n, labels = len(dataset), []
    for start in range(0, n, batch):
        idx = torch.arange(start, min(n, start + batch))
        if records is not None:
            for i in idx.tolist():
                data, label = records(i)
                w[i] = {"image": data, "y": np.asarray([label], dtype=np.int64)}
                labels.append(int(label))
            continue
        x, y = dataset.fetch(idx)
        xs, ys = x.numpy(), y.numpy()
        for k, i in enumerate(idx.tolist()):
            w[i] = {"x": np.ascontiguousarray(xs[k]), "y": np.ascontiguousarray(ys[k]).reshape(-1)}
        if y.dim() == 1 and not y.is_floating_point():
            labels += y.tolist()
    w.done()
    w.merge()
    return n, labels if len(labels) == n else []


def pack(bundle, out: str | Path, shard_bytes: int = 64 << 20, source: dict | None = None) -> dict:
    """Write a DataBundle's train and validation splits as LitData shards under `out` (a new or empty folder)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"-o {out} exists and is not an empty folder; choose a new folder for the packed dataset")
    if shard_bytes < 4096:
        raise DataError(f"--shard-size {shard_bytes} bytes is too small; use at least 4KB (e.g. 64MB)")
    tmp = out.with_name(f".{out.name}.packing-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        written = {split: _write_split(getattr(bundle, split), tmp / split, shard_bytes) for split in SPLITS}
        sizes = {split: n for split, (n, _) in written.items()}
        kind = "images" if getattr(bundle.train, "records", None) is not None else "arrays"
        meta = {
            "format": FORMAT, "kind": kind, "spec": asdict(bundle.spec), "sizes": sizes,
            "source": source or {"name": bundle.spec.name},
            "tokenizer": bundle.tokenizer.to_json() if bundle.tokenizer is not None else None,
            "unigram_val_loss": bundle.unigram_val_loss, "ground_truth_val_loss": bundle.ground_truth_val_loss,
            "image": getattr(bundle.train, "image_meta", None),
            "labels": {split: labels for split, (_, labels) in written.items() if labels},
            "source_index": {split: getattr(bundle, split).source_index.tolist() for split in SPLITS
                             if getattr(getattr(bundle, split), "source_index", None) is not None},
        }
        (tmp / "plait.json").write_text(json.dumps(meta, indent=1))
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


# --------------------------------------------------------------------------- reading


# what `plait data pack` writes: numpy arrays (with or without LitData's header) and encoded image bytes. LitData
# maps any other name, or a sub-type such as `str:pickle`, to a serializer that may unpickle (pickle, graph) or
# call a media decoder on the bytes; an index naming one is refused.
_FORMATS = re.compile(r"numpy|bytes|no_header_numpy:\d{1,2}")
_SPEC_TYPES = (None, "builtins.dict", "builtins.list", "builtins.tuple")


def check_formats(index: Path, config: dict, formats) -> None:
    """Refuse an index whose fields, item loader or encryption are not the ones plait writes."""
    if not isinstance(formats, list) or not formats:
        raise DataError(f"{index}: data_format must list the fields' formats; re-pack it with `plait data pack`")
    for f in formats:
        if not isinstance(f, str) or not _FORMATS.fullmatch(f):
            raise DataError(f"{index} declares a field of format {str(f)[:40]!r}; plait reads only the formats it "
                            "writes (numpy arrays, image bytes), never a pickled or decoded one: re-pack it with "
                            "`plait data pack`")
    if config.get("encryption") or config.get("item_loader") not in (None, "PyTreeLoader"):
        raise DataError(f"{index} uses item loader {str(config.get('item_loader'))[:40]!r} and encryption "
                        f"{str(config.get('encryption'))[:40]!r}; plait reads only the PyTreeLoader shards it writes, "
                        "unencrypted: re-pack it with `plait data pack`")
    try:
        spec = json.loads(config.get("data_spec") or "null")
    except (ValueError, TypeError, RecursionError):
        raise DataError(f"{index}: its data_spec is not JSON; re-pack it with `plait data pack`") from None
    for item in json_objects(spec):
        if item.get("type") not in _SPEC_TYPES:
            raise DataError(f"{index}: its data_spec names type {str(item.get('type'))[:60]!r}; plait writes "
                            "dicts of arrays only: re-pack it with `plait data pack`")


def check_split(folder: Path, expected: int) -> None:
    """The index must list shards that exist with the sizes it records, and as many samples as plait.json says."""
    index = folder / "index.json"
    if not index.is_file():
        raise DataError(f"{index} is missing: {folder} is not a packed split; re-run `plait data pack`")
    try:
        meta = json.loads(index.read_text(encoding="utf-8"))
        chunks, config = meta["chunks"], meta["config"]
        if not isinstance(config, dict) or not isinstance(chunks, list) or not all(isinstance(c, dict) for c in chunks):
            raise TypeError("'config' must be an object and 'chunks' a list of objects")
        formats = config.get("data_format") or []
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise DataError(f"{index} is not a LitData index ({type(e).__name__}: {str(e)[:120]}); re-run "
                        "`plait data pack`") from None
    check_formats(index, config, formats)
    total = 0
    for c in chunks:
        name = c.get("filename")
        if not isinstance(name, str) or not name or Path(name).name != name or not (folder / name).is_file():
            raise DataError(f"{index} lists shard {str(name)[:80]!r}, which is not in {folder}; the index does not "
                            "match its shards: copy the whole folder again or re-run `plait data pack`")
        f = folder / name
        if not isinstance(c.get("chunk_size"), int) or c["chunk_size"] < 0:
            raise DataError(f"{index}: shard {name!r} has chunk_size {str(c.get('chunk_size'))[:40]!r}, not a count; "
                            "re-run `plait data pack`")
        if f.stat().st_size != c.get("chunk_bytes"):
            raise DataError(f"shard {f} has {f.stat().st_size} bytes but {index} says {c.get('chunk_bytes')}: it is "
                            "truncated or corrupt; copy it again or re-run `plait data pack`")
        total += c["chunk_size"]
    if total != expected:
        raise DataError(f"{index} holds {total} samples but {folder.parent / 'plait.json'} says {expected}: the index "
                        "does not match its shards; re-run `plait data pack`")


class PackedSplit:
    """One split of a packed dataset: `fetch(idx)` reads samples by index; opened lazily in each process."""

    def __init__(self, path: str, size: int, kind: str, on_bad: str = "error"):
        self.path, self.size, self.kind, self.on_bad, self.skipped = path, size, kind, on_bad, 0
        self._ds, self._pid = None, None

    def __len__(self) -> int:
        return self.size

    def __getstate__(self):
        return {**self.__dict__, "_ds": None, "_pid": None}

    def _open(self):
        if self._ds is None or self._pid != os.getpid():
            from litdata import StreamingDataset  # lazily: only packed reading needs LitData

            # batch_decode=False: a random read inflates its own sample, not the 256 around it
            self._ds = StreamingDataset(self.path, shuffle=False, batch_decode=False)
            self._pid = os.getpid()
            # An int index is a global sample index in LitData (its len() is this rank's share under torch.distributed,
            # which plait does not use: its own sampler gives each rank its slice); check_split checked the count.
        return self._ds

    def raw(self, i: int) -> dict:
        """Sample i as stored (numpy arrays, or an image's bytes), with the file it came from in the error."""
        try:
            return self._open()[int(i)]
        except DataError:
            raise
        except Exception as e:  # a shard that passed the size check but does not decode (bit rot)
            raise DataError(f"{self._shard_of(int(i))}: sample {i} cannot be read ({type(e).__name__}: {e}); the shard "
                            "is corrupt: copy it again or re-run `plait data pack`") from None

    def _shard_of(self, i: int) -> str:
        """The file holding sample i (LitData's writer numbers samples shard by shard, in index order)."""
        try:
            chunks = json.loads((Path(self.path) / "index.json").read_text())["chunks"]
            for c in chunks:
                if i < int(c["chunk_size"]):
                    return str(Path(self.path) / c["filename"])
                i -= int(c["chunk_size"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return self.path

    def _good(self, i: int) -> dict:
        """Sample i, or with on_bad = "skip" the next one (in index order) that reads: a function of i only."""
        for k in range(self.size):
            try:
                return self.raw((i + k) % self.size)
            except DataError:
                if self.on_bad != "skip":
                    raise
                self.skipped += 1
        raise DataError(f"no sample of {self.path} can be read; re-run `plait data pack`")

    def fetch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "images":
            raise DataError("packed image splits are read through plait.data.images.PackedImages")
        rows = [self._good(i) for i in idx.tolist()]
        x = torch.from_numpy(np.stack([r["x"] for r in rows]))
        y = torch.from_numpy(np.stack([r["y"] for r in rows]))
        if y.dim() == 2 and y.shape[1] == 1:
            y = y[:, 0]
        return x, y


def packed_source(data_cfg, model_cfg):
    """data.name = "packed": the train and validation splits of a folder written by `plait data pack`."""
    if not data_cfg.path:
        raise DataError("data.name = 'packed' needs data.path = the folder `plait data pack` wrote")
    if is_remote(data_cfg.path):
        raise DataError(f"data.path = {data_cfg.path!r}: object-store URLs are not supported by this version of plait's "
                        "packed source; copy the folder to a local or shared filesystem")
    meta = read_meta(data_cfg.path)
    splits = {}
    for split in SPLITS:
        folder = Path(data_cfg.path) / split
        check_split(folder, int(meta["sizes"][split]))
        splits[split] = PackedSplit(str(folder), int(meta["sizes"][split]), meta["kind"],
                                    data_cfg.on_bad_sample)
    spec = DataSpec(**meta["spec"])
    if meta["kind"] == "images":
        splits = {k: PackedImages(v, meta["image"], data_cfg.on_bad_sample) for k, v in splits.items()}
    for split, ids in (meta.get("source_index") or {}).items():
        splits[split].source_index = torch.tensor(ids, dtype=torch.long)
    for split, labels in (meta.get("labels") or {}).items():
        splits[split].stored_labels = torch.tensor(labels, dtype=torch.long)
    tok = tokenizer_from_json(meta["tokenizer"]) if meta.get("tokenizer") else None
    if spec.task == "lm" and model_cfg.context != spec.input_shape[0]:
        raise DataError(f"data.path = {data_cfg.path!r} was packed with model.context = {spec.input_shape[0]}; set "
                        f"model.context={spec.input_shape[0]} or pack again with --set model.context={model_cfg.context}")
    return DataBundle(splits["train"], splits["val"], spec, tok, meta.get("unigram_val_loss"),
                      meta.get("ground_truth_val_loss"))
