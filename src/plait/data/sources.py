"""Data sources chosen by `data.name`, each returning train and validation datasets and a DataSpec."""

from __future__ import annotations

import hashlib
import os
import pickle
import sysconfig
import zipfile
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from plait.data.captions import digit_captions
from plait.data.chat import chat_source
from plait.data.datasets import DocumentWindows, Tensors, TokenWindows, split_tensors
from plait.data.digits import digits_arrays
from plait.data.exclude import exclude
from plait.data.hf_tokenizer import HFTokenizer
from plait.data.images import image_folder
from plait.data.packed import packed_source
from plait.data.placed import PlacedDigits
from plait.data.preference import preference_source
from plait.data.sampler import balanced_class_weights, labels_of
from plait.data.spec import SPLIT_SEED, DataBundle, DataSpec
from plait.data.stream import keep_classes
from plait.data.table import table_source
from plait.data.tokenizer import CharTokenizer
from plait.data.user import factory_source
from plait.errors import DataError
from plait.files import cache_dir, publish


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's own .py sources (no site-packages), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    files.sort()
    if not files:
        raise DataError(f"no .py files found under the standard library at {root}")
    return root, files


def split_files(root: Path, files: list[Path], val_fraction: float) -> tuple[list[Path], list[Path]]:
    """Deterministic split by a checksum of each file's relative path."""
    cut = int(val_fraction * 10_000)
    val = [f for f in files if zlib.crc32(str(f.relative_to(root)).encode()) % 10_000 < cut]
    val_set = set(val)
    train = [f for f in files if f not in val_set]
    if not val:
        val, train = train[-1:], train[:-1]
    if not train:
        raise DataError(f"{root}: too few files to split into train and validation; add files or lower data.val_fraction")
    return train, val


def _read(files: list[Path]) -> str:
    return _read_documents(files)[0]


def _read_documents(files: list[Path]) -> tuple[str, np.ndarray]:
    """The files' text, joined by newlines, and where each file begins in it (characters): the documents of
    data.pack = true."""
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    starts = np.concatenate([[0], np.cumsum([len(t) + 1 for t in texts])[:-1]]).astype(np.int64)
    return "\n".join(texts), starts


def _text_parts(name: str, train: list[Path], val: list[Path], data_cfg, context: int) -> DataBundle:
    """A bundle of text files, each read once; with data.pack = true each file is a document."""
    (train_text, train_starts), (val_text, val_starts) = _read_documents(train), _read_documents(val)
    starts = (train_starts, val_starts) if data_cfg.pack else None
    return _text_bundle(name, train_text, val_text, data_cfg, context, starts)


def unigram_loss(train_ids: np.ndarray, val_ids: np.ndarray, vocab: int) -> float:
    """Cross-entropy (nats) of val tokens under add-one-smoothed train token frequencies."""
    counts = np.bincount(train_ids.astype(np.int64), minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val_ids.astype(np.int64)].mean())


def _text_bundle(name: str, train_text: str, val_text: str, data_cfg, context: int,
                 starts: tuple[np.ndarray, np.ndarray] | None = None) -> DataBundle:
    """starts: each document's first character in the train and validation text (data.pack = true)."""
    if data_cfg.tokenizer:  # a Hugging Face tokenizer.json (e.g. the one next to train.init_from's checkpoint)
        tok = HFTokenizer.from_file(data_cfg.tokenizer)
    else:
        tok = CharTokenizer.fit(train_text, data_cfg.min_char_count)
    if starts is not None and data_cfg.tokenizer:  # tokens are not characters: each document encoded on its own
        (train_ids, ts), (val_ids, vs) = (_encode_documents(tok, t, s) for t, s in ((train_text, starts[0]),
                                                                                       (val_text, starts[1])))
        starts = (ts, vs)
    else:
        train_ids, val_ids = tok.encode(train_text), tok.encode(val_text)
    # The baseline is measured on the tokens the validation loss is measured on.
    n = max(0, (len(val_ids) - 1) // context) * context + 1
    baseline = unigram_loss(train_ids, val_ids[1:n], tok.vocab_size) if n > 1 else float("nan")  # n = 1: refused below
    return _token_bundle(name, tok, train_ids, val_ids, context, baseline, starts)


def _encode_documents(tok, text: str, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The text's tokens, each document encoded alone, and where each begins in tokens."""
    ends = [*starts[1:], len(text)]
    ids = [tok.encode(text[a:b]) for a, b in zip(starts, ends)]
    return np.concatenate(ids), np.concatenate([[0], np.cumsum([len(i) for i in ids])[:-1]]).astype(np.int64)


def _token_bundle(name: str, tok, train_ids: np.ndarray, val_ids: np.ndarray, context: int,
                  baseline: float, starts: tuple[np.ndarray, np.ndarray] | None = None) -> DataBundle:
    if starts is None:
        train, val = TokenWindows(train_ids, context), TokenWindows(val_ids, context)
    else:
        train, val = DocumentWindows(train_ids, starts[0], context), DocumentWindows(val_ids, starts[1], context)
    if len(val) == 0 or len(train) == 0:
        raise DataError(
            f"data.name = {name!r}: the {'validation' if len(val) == 0 else 'training'} text is shorter than one "
            f"window of model.context + 1 = {context + 1} characters; add text or lower model.context"
        )
    spec = DataSpec(name=name, task="lm", input_shape=[context], vocab_size=tok.vocab_size, tokens_per_sample=context,
                    packed=starts is not None)
    return DataBundle(train, val, spec, tok, baseline)


CORPUS_CACHE_VERSION = 1  # bump when the tokenizer or the split changes what a cached corpus holds


def _stdlib_key(root: Path, train: list[Path], val: list[Path], min_count: int) -> str:
    h = hashlib.sha256(f"{CORPUS_CACHE_VERSION}|{root}|{min_count}".encode())
    for part, files in (("train", train), ("val", val)):
        h.update(part.encode())
        for f in files:
            st = f.stat()
            h.update(f"{f.relative_to(root)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def stdlib_text(data_cfg, model_cfg) -> DataBundle:
    """The standard library as text. Its tokens are cached (cache_dir(), ~60 MB, keyed by every file's size and
    mtime, the split and min_char_count): reading and tokenizing 29 MB of text cost every run's workers 2.5 s."""
    root, files = stdlib_files()
    train, val = split_files(root, files, data_cfg.val_fraction)
    if data_cfg.tokenizer or data_cfg.pack:  # documents: the cached stream does not keep where each file begins
        return _text_parts("stdlib-text", train, val, data_cfg, model_cfg.context)
    path = cache_dir() / f"stdlib-text-{_stdlib_key(root, train, val, data_cfg.min_char_count)}.npz"
    try:
        with np.load(path) as z:
            tok = CharTokenizer([str(c) for c in z["chars"]])
            train_ids, val_ids, baseline = z["train"], z["val"], float(z["unigram"])
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):  # absent, or a partial write of another
        bundle = _text_bundle("stdlib-text", _read(train), _read(val), data_cfg, model_cfg.context)
        _save_corpus(path, bundle)
        return bundle
    return _token_bundle("stdlib-text", tok, train_ids, val_ids, model_cfg.context, baseline)


def _save_corpus(path: Path, bundle: DataBundle) -> None:
    """Written whole or not at all (a temporary file renamed); a cache that cannot be written is only skipped."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.savez(f, chars=np.array(bundle.tokenizer.chars[1:]), train=bundle.train.tokens.numpy(),
                     val=bundle.val.tokens.numpy(), unigram=np.float64(bundle.unigram_val_loss))
        publish(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def user_text(data_cfg, model_cfg) -> DataBundle:
    path = Path(data_cfg.path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if len(files) >= 2:
            train, val = split_files(path, files, data_cfg.val_fraction)
            return _text_parts("text", train, val, data_cfg, model_cfg.context)
        if not files:
            raise DataError(f"data.path = {str(path)!r} is an empty folder; point it at text files")
        path = files[0]
    if not path.is_file():
        raise DataError(f"data.path = {str(path)!r} does not exist; set it to a text file or a folder of them")
    text = path.read_text(encoding="utf-8", errors="replace")
    cut = int(len(text) * (1 - data_cfg.val_fraction))
    one = (np.zeros(1, dtype=np.int64),) * 2 if data_cfg.pack else None  # one file: one document in each part
    return _text_bundle("text", text[:cut], text[cut:], data_cfg, model_cfg.context, one)


def _class_bundle(name: str, x: torch.Tensor, y: torch.Tensor, val_fraction: float,
                  num_classes: int | None = None) -> DataBundle:
    x = x.float()
    y = y.long()
    if len(y) and int(y.min()) < 0:
        raise DataError(f"data.name = {name!r}: labels must be class indices >= 0; found {int(y.min())}")
    train, val = split_tensors(name, x, y, val_fraction)
    classes = num_classes if num_classes is not None else int(y.max()) + 1
    spec = DataSpec(name=name, task="classification", input_shape=list(x.shape[1:]), num_classes=classes)
    return DataBundle(train, val, spec)


def digits(data_cfg, model_cfg) -> DataBundle:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images), scaled to [0, 1], shape (1, 8, 8)."""
    images, labels = digits_arrays()
    x = torch.from_numpy(images).float().div(16.0).unsqueeze(1)
    return _class_bundle("digits", x, torch.from_numpy(labels), data_cfg.val_fraction)


def large_digits(data_cfg, model_cfg) -> DataBundle:
    """Digits enlarged and placed at random on a large canvas, made per batch (plait.data.placed)."""
    size, scale = data_cfg.canvas_size, data_cfg.digit_scale  # 8 * scale <= size: checked with the keys
    images, labels = digits_arrays()
    small = torch.from_numpy(images).float().div(16.0)
    y = torch.from_numpy(labels).long()
    g = torch.Generator().manual_seed(SPLIT_SEED)
    at = torch.randint(0, size - 8 * scale + 1, (len(y), 2), generator=g)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_val = max(1, int(len(y) * data_cfg.val_fraction))
    whole = PlacedDigits(small, y, at, size, scale)
    train, val = whole.subset(perm[n_val:]), whole.subset(perm[:n_val])
    train.source_index, val.source_index = perm[n_val:], perm[:n_val]  # type: ignore[attr-defined]
    spec = DataSpec(name="large-digits", task="classification", input_shape=[1, size, size], num_classes=10)
    return DataBundle(train, val, spec)


def synthetic(data_cfg, model_cfg) -> DataBundle:
    """Gaussian inputs labelled by a fixed random linear teacher: learnable, any size, no files."""
    g = torch.Generator().manual_seed(SPLIT_SEED)
    n, f, c = data_cfg.synthetic_samples, data_cfg.synthetic_features, data_cfg.synthetic_classes
    x = torch.randn(n, f, generator=g)
    teacher = torch.randn(f, c, generator=g)
    return _class_bundle("synthetic", x, (x @ teacher).argmax(1), data_cfg.val_fraction, c)


def clicks(data_cfg, model_cfg) -> DataBundle:
    """A synthetic click log with a known ground truth: an FM-style logistic model.

    Each sample has one category per field (Zipf-distributed, so a few ids dominate, as in real
    logs; the fields' cardinalities differ by orders of magnitude) and a few dense features.
    The click probability is sigmoid(bias + sum_i w_i[c_i] + sum_{i<j} <v_i[c_i], v_j[c_j]> + u . dense),
    so the best possible validation loss (the ground truth's own) is known and reported.
    Rows are the categorical ids (as floats: exact below 2^24) followed by the dense features.
    """
    g = torch.Generator().manual_seed(SPLIT_SEED)
    n, cards, d = data_cfg.synthetic_samples, list(data_cfg.clicks_cardinalities), data_cfg.clicks_dense
    ids, first, latent = [], torch.zeros(n), []
    for card in cards:
        zipf = 1.0 / torch.arange(1, card + 1, dtype=torch.float64) ** 1.1
        c = torch.multinomial(zipf / zipf.sum(), n, replacement=True, generator=g)
        ids.append(c)
        first += (torch.randn(card, generator=g) * 0.5)[c]
        latent.append((torch.randn(card, 4, generator=g) * 0.4)[c])
    v = torch.stack(latent, 1)  # (n, fields, 4)
    pairwise = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(-1)
    dense = torch.randn(n, d, generator=g)
    logit = -0.5 + first + pairwise + dense @ (torch.randn(d, generator=g) * 0.5)
    y = torch.bernoulli(torch.sigmoid(logit), generator=g)
    x = torch.cat([torch.stack(ids, 1).float(), dense], 1)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_val = max(1, int(n * data_cfg.val_fraction))
    tr, va = perm[n_val:], perm[:n_val]
    spec = DataSpec(name="clicks", task="binary", input_shape=[len(cards) + d], cardinalities=cards, dense_features=d)
    truth = float(torch.nn.functional.binary_cross_entropy_with_logits(logit[va], y[va]))
    return DataBundle(Tensors(x[tr], y[tr]), Tensors(x[va], y[va]), spec, ground_truth_val_loss=truth)


def user_tensors(data_cfg, model_cfg) -> DataBundle:
    """A .pt or .npz file holding 'x' and 'y', or a 2-D .npy array whose last column is the label."""
    path = Path(data_cfg.path)
    if not path.is_file():
        raise DataError(f"data.path = {str(path)!r} does not exist; set it to a .pt, .npz or .npy file")
    try:
        if path.suffix == ".pt":
            obj = torch.load(path, weights_only=True, map_location="cpu")
            x, y = obj["x"], obj["y"]
        elif path.suffix == ".npz":
            obj = np.load(path, allow_pickle=False)
            x, y = torch.from_numpy(obj["x"]), torch.from_numpy(obj["y"])
        elif path.suffix == ".npy":
            arr = np.load(path, allow_pickle=False)
            if arr.ndim != 2 or arr.shape[1] < 2:
                raise DataError(f"{path}: a .npy dataset must be 2-D (samples, features + label); got shape {arr.shape}")
            x, y = torch.from_numpy(arr[:, :-1]), torch.from_numpy(arr[:, -1])
        else:
            raise DataError(f"data.path = {str(path)!r}: unsupported suffix {path.suffix!r}; use .pt, .npz or .npy")
    except (KeyError, TypeError, IndexError) as e:
        raise DataError(f"{path}: expected a mapping with tensors 'x' and 'y' ({e})") from None
    except (pickle.UnpicklingError, ValueError, RuntimeError, OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read it as a {path.suffix} dataset ({e})") from None
    return _class_bundle("tensors", torch.as_tensor(x), torch.as_tensor(y), data_cfg.val_fraction)


SOURCES = {"stdlib-text": stdlib_text, "text": user_text, "digits": digits, "large-digits": large_digits,
           "digit-captions": digit_captions,
           "synthetic": synthetic, "clicks": clicks,
           "tensors": user_tensors, "images": image_folder, "packed": packed_source, "table": table_source,
           "chat": chat_source, "preference": preference_source}


def build_data(data_cfg, model_cfg) -> DataBundle:
    """Load the configured source; every rank gets the same datasets (sampling is by index)."""
    if getattr(data_cfg, "factory", ""):  # the user's own dataset: data.name is not used
        bundle = factory_source(data_cfg, model_cfg)
    elif data_cfg.name not in SOURCES:
        raise DataError(f"data.name = {data_cfg.name!r} is not one of: {', '.join(SOURCES)}")
    else:
        bundle = SOURCES[data_cfg.name](data_cfg, model_cfg)
    if getattr(data_cfg, "exclude", ""):
        bundle = exclude(bundle, data_cfg.exclude)
    if getattr(data_cfg, "classes", []):
        bundle = keep_classes(bundle, data_cfg.classes, data_cfg.name)
    if getattr(data_cfg, "class_weights", "none") == "balanced":
        if bundle.spec.task != "classification":
            raise DataError(f"data.class_weights = 'balanced' weighs classes; data.name = {data_cfg.name!r} is a "
                            f"{bundle.spec.task!r} task: set data.class_weights='none'")
        spec = replace(bundle.spec, class_weights=balanced_class_weights(labels_of(bundle.train), bundle.spec.num_classes))
        bundle = replace(bundle, spec=spec)
    return bundle
