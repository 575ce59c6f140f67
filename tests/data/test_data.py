"""Data: the layout-independent sampler, the tokenizer, datasets, sources and the step loader."""

import math
import threading
import zlib

import numpy as np
import pytest
import torch

from plait.config import Config
from plait.data import build_data
from plait.data.datasets import Tensors, TokenWindows, eval_batches
from plait.data.loader import StepLoader
from plait.data.sampler import GlobalBatchSampler, micro_batches, shard
from plait.data.sources import split_files, unigram_loss
from plait.data.tokenizer import UNK, CharTokenizer
from plait.errors import DataError


def cfg_for(**data) -> Config:
    cfg = Config()
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def build(cfg: Config):
    return build_data(cfg.data, cfg.model)


# --------------------------------------------------------------------------- sampler


def test_sampler_is_a_function_of_seed_and_step():
    a, b = GlobalBatchSampler(100, 16, seed=7), GlobalBatchSampler(100, 16, seed=7)
    steps = [0, 5, 1, 12, 5, 0, 30]  # out of order, across epochs: the epoch cache must not matter
    for s in steps:
        assert torch.equal(a.global_batch(s), b.global_batch(s))
    fresh = GlobalBatchSampler(100, 16, seed=7)
    assert torch.equal(fresh.global_batch(12), a.global_batch(12))
    assert a.global_batch(0).dtype == torch.int64 and len(a.global_batch(3)) == 16


def test_sampler_differs_for_different_seeds():
    a, b = GlobalBatchSampler(100, 16, seed=7), GlobalBatchSampler(100, 16, seed=8)
    assert not torch.equal(a.global_batch(0), b.global_batch(0))
    assert not torch.equal(a.global_batch(9), b.global_batch(9))


@pytest.mark.parametrize("n, batch", [(10, 4), (7, 3), (5, 12), (16, 16)])
def test_each_epoch_is_a_permutation(n, batch):
    sampler = GlobalBatchSampler(n, batch, seed=3)
    epochs = 4
    steps = math.ceil(epochs * n / batch)
    stream = torch.cat([sampler.global_batch(s) for s in range(steps)])
    assert len(stream) == steps * batch
    perms = [stream[e * n:(e + 1) * n] for e in range(epochs)]
    for perm in perms:
        assert sorted(perm.tolist()) == list(range(n))
    # epochs are shuffled differently
    assert any(not torch.equal(perms[0], p) for p in perms[1:])


def test_batch_straddling_an_epoch_boundary():
    n, batch = 10, 4
    sampler = GlobalBatchSampler(n, batch, seed=11)
    epoch0 = torch.cat([sampler.global_batch(0), sampler.global_batch(1), sampler.global_batch(2)[:2]])
    straddle = sampler.global_batch(2)  # stream[8:12]: the end of epoch 0 and the start of epoch 1
    epoch1_start = straddle[2:]
    assert sorted(epoch0.tolist()) == list(range(n))
    assert torch.equal(straddle[:2], epoch0[8:])
    rest_of_epoch1 = torch.cat([sampler.global_batch(3), sampler.global_batch(4)])  # stream[12:20]
    assert sorted(torch.cat([epoch1_start, rest_of_epoch1]).tolist()) == list(range(n))


def test_empty_dataset_is_refused():
    with pytest.raises(ValueError, match="the dataset is empty"):
        GlobalBatchSampler(0, 4, seed=0)


@pytest.mark.parametrize("dp, micro", [(1, 16), (1, 4), (2, 8), (2, 2), (4, 4), (4, 1), (8, 2)])
def test_shards_and_micro_batches_reassemble_the_global_batch(dp, micro):
    sampler = GlobalBatchSampler(50, 16, seed=1)
    for step in (0, 3, 7):
        batch = sampler.global_batch(step)
        shards = [shard(batch, r, dp) for r in range(dp)]
        assert all(len(s) == 16 // dp for s in shards)
        assert torch.equal(torch.cat(shards), batch)
        for s in shards:
            mbs = micro_batches(s, micro)
            assert [len(m) for m in mbs] == [micro] * (len(s) // micro)
            assert torch.equal(torch.cat(mbs), s)


def test_shard_is_a_contiguous_slice():
    assert shard(torch.arange(12), 1, 3).tolist() == [4, 5, 6, 7]
    assert shard(torch.arange(12), 2, 3).tolist() == [8, 9, 10, 11]
    assert [m.tolist() for m in micro_batches(torch.arange(5), 2)] == [[0, 1], [2, 3], [4]]


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_fit_encode_decode():
    tok = CharTokenizer.fit("hello world")
    assert tok.chars == [UNK, " ", "d", "e", "h", "l", "o", "r", "w"]  # <unk> first, then code-point order
    assert tok.vocab_size == 9
    ids = tok.encode("hello world")
    assert ids.tolist() == [4, 3, 5, 5, 6, 1, 8, 6, 7, 5, 2]
    assert ids.dtype == np.int16
    assert tok.decode(ids) == "hello world"
    assert tok.decode([4, 99, -1]) == "h" + UNK + UNK


def test_tokenizer_min_count_maps_rare_chars_to_unk():
    tok = CharTokenizer.fit("aaabbc", min_count=2)
    assert tok.chars == [UNK, "a", "b"]
    assert tok.encode("abcz\u20ac").tolist() == [1, 2, 0, 0, 0]  # rare 'c', unseen 'z' and '€' are <unk>
    assert tok.decode(tok.encode("abc")) == "ab" + UNK
    assert CharTokenizer.fit("aaabbc", min_count=0).chars == CharTokenizer.fit("aaabbc", min_count=1).chars


def test_tokenizer_handles_non_ascii_and_the_unk_char():
    text = "héllo → wörld " + UNK
    tok = CharTokenizer.fit(text)
    assert UNK not in tok.chars[1:]
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(UNK).tolist() == [0]


def test_tokenizer_json_round_trip():
    tok = CharTokenizer.fit("héllo → wörld", min_count=1)
    again = CharTokenizer.from_json(tok.to_json())
    assert again.chars == tok.chars
    assert np.array_equal(again.encode("wörld?"), tok.encode("wörld?"))
    assert "→" in tok.to_json()  # written as the character itself, not an escape


# --------------------------------------------------------------------------- datasets


def test_token_windows():
    tokens = np.arange(100, 123, dtype=np.int16)  # 23 tokens
    ds = TokenWindows(tokens, context=5)
    assert len(ds) == 4  # (23 - 1) // 5
    x, y = ds.fetch(torch.tensor([0, 3, 1]))
    assert x.dtype == torch.int64 and x.shape == (3, 5) and y.shape == (3, 5)
    assert x.tolist() == [[100, 101, 102, 103, 104], [115, 116, 117, 118, 119], [105, 106, 107, 108, 109]]
    assert torch.equal(y, x + 1)  # targets are the inputs shifted by one
    for i in range(len(ds)):
        x, y = ds.fetch(torch.tensor([i]))
        assert torch.equal(x[0], torch.as_tensor(tokens[i * 5:i * 5 + 5]).long())
        assert torch.equal(y[0], torch.as_tensor(tokens[i * 5 + 1:i * 5 + 6]).long())


@pytest.mark.parametrize("n, context, windows", [(21, 5, 4), (20, 5, 3), (5, 5, 0), (6, 5, 1), (0, 5, 0)])
def test_token_windows_length(n, context, windows):
    assert len(TokenWindows(np.zeros(n, dtype=np.int16), context)) == windows


def test_tensors_dataset_and_eval_batches():
    ds = Tensors(torch.arange(10).float()[:, None], torch.arange(10) % 3)
    x, y = ds.fetch(torch.tensor([4, 2]))
    assert x.tolist() == [[4.0], [2.0]] and y.tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"inputs \(10\) and labels \(9\) differ in length"):
        Tensors(torch.zeros(10), torch.zeros(9))
    assert [b.tolist() for b in eval_batches(ds, 7, 3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [b.tolist() for b in eval_batches(ds, 100, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# --------------------------------------------------------------------------- file split and baseline


def test_split_files_is_deterministic_disjoint_and_complete(tmp_path):
    root = tmp_path
    files = sorted(root / f"pkg{i % 7}" / f"mod_{i}.py" for i in range(300))
    train, val = split_files(root, files, 0.1)
    assert (train, val) == split_files(root, list(files), 0.1)
    assert not set(train) & set(val)
    assert sorted(train + val) == files
    expected_val = [f for f in files if zlib.crc32(str(f.relative_to(root)).encode()) % 10_000 < 1000]
    assert val == expected_val
    assert 10 < len(val) < 60  # about 10% of 300
    # a larger fraction only moves files from train to val
    train2, val2 = split_files(root, files, 0.3)
    assert set(val) <= set(val2) and set(train2) <= set(train)


def test_split_files_falls_back_to_the_last_file(tmp_path):
    files = [tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"]
    assert all(zlib.crc32(f.name.encode()) % 10_000 >= 1 for f in files)
    train, val = split_files(tmp_path, files, 0.0001)  # cut = 1: no file checksums below it
    assert (train, val) == (files[:2], files[2:])


def test_split_files_with_no_train_files_is_an_error(tmp_path):
    with pytest.raises(DataError, match="too few files to split into train and validation"):
        split_files(tmp_path, [tmp_path / "only.py"], 0.1)


def test_unigram_loss_by_hand():
    # add-one counts over vocab 3: token 0 -> 2+1, token 1 -> 1+1, token 2 -> 0+1; total 6
    got = unigram_loss(np.array([0, 0, 1], dtype=np.int16), np.array([0, 2, 1], dtype=np.int16), 3)
    expected = -(math.log(3 / 6) + math.log(1 / 6) + math.log(2 / 6)) / 3
    assert got == pytest.approx(expected, rel=1e-12)
    assert unigram_loss(np.array([0, 1]), np.array([0, 1]), 2) == pytest.approx(math.log(2), rel=1e-12)


# --------------------------------------------------------------------------- built-in sources


def test_digits_source():
    bundle = build(cfg_for(name="digits"))
    assert (len(bundle.train), len(bundle.val)) == (1618, 179)  # 1797 samples, int(0.1 * 1797) held out
    spec = bundle.spec
    assert (spec.name, spec.task, spec.input_shape, spec.num_classes) == ("digits", "classification", [1, 8, 8], 10)
    for ds in (bundle.train, bundle.val):
        assert ds.x.shape[1:] == (1, 8, 8) and ds.x.dtype == torch.float32 and ds.y.dtype == torch.int64
    x = torch.cat([bundle.train.x, bundle.val.x])
    y = torch.cat([bundle.train.y, bundle.val.y])
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    assert sorted(set(y.tolist())) == list(range(10))
    assert bundle.tokenizer is None and bundle.unigram_val_loss is None
    quarter = build(cfg_for(name="digits", val_fraction=0.25))
    assert (len(quarter.train), len(quarter.val)) == (1348, 449)


def test_digits_read_without_scikit_learn_are_load_digits(monkeypatch):
    """The shipped CSV, read directly, is load_digits() exactly; with the file gone, load_digits() is the source."""
    import importlib.util

    from sklearn.datasets import load_digits

    from plait.data import sources

    d = load_digits()
    images, labels = sources.digits_arrays()
    assert np.array_equal(images, d.images) and np.array_equal(labels, d.target) and labels.dtype == d.target.dtype
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    images, labels = sources.digits_arrays()
    assert np.array_equal(images, d.images) and np.array_equal(labels, d.target)


def test_synthetic_source_is_labelled_by_a_fixed_teacher():
    cfg = cfg_for(name="synthetic", synthetic_samples=200, synthetic_features=6, synthetic_classes=4)
    a, b = build(cfg), build(cfg)
    assert (len(a.train), len(a.val)) == (180, 20)
    assert (a.spec.name, a.spec.input_shape, a.spec.num_classes) == ("synthetic", [6], 4)
    for part in ("train", "val"):
        assert torch.equal(getattr(a, part).x, getattr(b, part).x)
        assert torch.equal(getattr(a, part).y, getattr(b, part).y)
    # the labels are argmax(x @ teacher) for the teacher drawn after x from generator seed 0
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=g)
    teacher = torch.randn(6, 4, generator=g)
    got_x = torch.cat([a.train.x, a.val.x])
    got_y = torch.cat([a.train.y, a.val.y])
    assert torch.equal(got_y, (got_x @ teacher).argmax(1))
    assert sorted(got_x[:, 0].tolist()) == sorted(x[:, 0].tolist())  # the split is a permutation of all samples


def test_synthetic_num_classes_is_the_configured_one():
    bundle = build(cfg_for(name="synthetic", synthetic_samples=8, synthetic_features=64, synthetic_classes=10))
    assert bundle.spec.num_classes == 10


# --------------------------------------------------------------------------- user text


def _text_cfg(path, val_fraction=0.2, context=16, min_char_count=1) -> Config:
    cfg = cfg_for(name="text", path=str(path), val_fraction=val_fraction, min_char_count=min_char_count)
    cfg.model.context = context
    return cfg


def test_user_text_file(tmp_path):
    text = "".join(chr(ord("a") + (i * 7) % 26) for i in range(999)) + "Z"  # 'Z' only at the very end
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    bundle = build(_text_cfg(path, val_fraction=0.2, context=16))
    tok = bundle.tokenizer
    assert len(bundle.train.tokens) == 800 and len(bundle.val.tokens) == 200
    assert (len(bundle.train), len(bundle.val)) == (799 // 16, 199 // 16)
    assert tok.decode(bundle.train.tokens.tolist()) == text[:800]
    assert tok.chars == [UNK] + sorted(set(text[:800]))  # fitted on train only: 'Z' is <unk>
    assert int(bundle.val.tokens[-1]) == 0
    spec = bundle.spec
    assert (spec.name, spec.task, spec.input_shape, spec.vocab_size, spec.tokens_per_sample) == (
        "text", "lm", [16], tok.vocab_size, 16)
    # the baseline is measured on exactly the tokens the validation windows predict
    n = len(bundle.val) * 16
    expected = unigram_loss(bundle.train.tokens.numpy(), bundle.val.tokens.numpy()[1:n + 1], tok.vocab_size)
    assert bundle.unigram_val_loss == pytest.approx(expected, rel=1e-12)
    x, y = bundle.val.fetch(torch.tensor([len(bundle.val) - 1]))
    assert int(y[0, -1]) == int(bundle.val.tokens[n])


def test_user_text_folder_splits_by_file(tiny_text):
    bundle = build(_text_cfg(tiny_text, val_fraction=0.1, context=32))
    files = sorted(tiny_text.iterdir())
    train, val = split_files(tiny_text, files, 0.1)
    assert train and val

    def joined(fs):
        return "\n".join(f.read_text(encoding="utf-8") for f in fs)

    assert bundle.tokenizer.decode(bundle.train.tokens.tolist()) == joined(train)
    assert bundle.tokenizer.decode(bundle.val.tokens.tolist()) == joined(val)
    assert len(bundle.train) == (len(joined(train)) - 1) // 32


def test_folder_with_one_file_is_that_file(tmp_path):
    (tmp_path / "only.txt").write_text("abcdefghij" * 20)
    (tmp_path / ".hidden").write_text("ignored")
    bundle = build(_text_cfg(tmp_path, val_fraction=0.25, context=8))
    assert (len(bundle.train.tokens), len(bundle.val.tokens)) == (150, 50)


def test_files_in_hidden_folders_are_skipped(tmp_path):
    visible = {"a.txt": "alpha " * 30, "b.txt": "beta " * 30, "c.txt": "gamma " * 30}
    for name, text in visible.items():
        (tmp_path / name).write_text(text)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n" * 10)
    bundle = build(_text_cfg(tmp_path, val_fraction=0.3, context=4))
    # train and val are each the files joined by newlines: total = characters + files - 2
    total = sum(len(t) for t in visible.values()) + len(visible) - 2
    assert len(bundle.train.tokens) + len(bundle.val.tokens) == total


def test_user_text_errors(tmp_path):
    with pytest.raises(DataError, match=r"data.path = '.*missing.txt' does not exist"):
        build(_text_cfg(tmp_path / "missing.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"data.path = '.*empty' is an empty folder"):
        build(_text_cfg(tmp_path / "empty"))
    (tmp_path / "short.txt").write_text("x" * 30)
    with pytest.raises(DataError, match=r"the validation text is shorter than one window of model.context \+ 1 = 17"):
        build(_text_cfg(tmp_path / "short.txt", val_fraction=0.2, context=16))


# --------------------------------------------------------------------------- user tensors


def _rows(n=50, features=3):
    """Inputs whose first feature is the row number; labels row % 3 (so x and y can be matched up)."""
    x = torch.arange(n, dtype=torch.float64)[:, None].repeat(1, features)
    x[:, 1:] = torch.rand(n, features - 1, dtype=torch.float64)
    return x, torch.arange(n) % 3


def _check_tensor_bundle(bundle, n=50, features=3):
    assert (len(bundle.train), len(bundle.val)) == (n - n // 10, n // 10)
    assert (bundle.spec.name, bundle.spec.input_shape, bundle.spec.num_classes) == ("tensors", [features], 3)
    x = torch.cat([bundle.train.x, bundle.val.x])
    y = torch.cat([bundle.train.y, bundle.val.y])
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert sorted(x[:, 0].long().tolist()) == list(range(n))
    assert torch.equal(y, x[:, 0].long() % 3)


def test_user_tensors_pt(tmp_path):
    x, y = _rows()
    torch.save({"x": x, "y": y}, tmp_path / "d.pt")
    _check_tensor_bundle(build(cfg_for(name="tensors", path=str(tmp_path / "d.pt"))))


def test_user_tensors_npz(tmp_path):
    x, y = _rows()
    np.savez(tmp_path / "d.npz", x=x.numpy(), y=y.numpy())
    _check_tensor_bundle(build(cfg_for(name="tensors", path=str(tmp_path / "d.npz"))))


def test_user_tensors_npy_last_column_is_the_label(tmp_path):
    x, y = _rows(features=4)
    np.save(tmp_path / "d.npy", torch.cat([x, y[:, None].double()], dim=1).numpy())
    _check_tensor_bundle(build(cfg_for(name="tensors", path=str(tmp_path / "d.npy"))), features=4)


def test_user_tensors_errors(tmp_path):
    with pytest.raises(DataError, match=r"data.path = '.*nope.pt' does not exist; set it to a .pt, .npz or .npy file"):
        build(cfg_for(name="tensors", path=str(tmp_path / "nope.pt")))
    (tmp_path / "d.csv").write_text("1,2,3\n")
    with pytest.raises(DataError, match=r"unsupported suffix '\.csv'; use \.pt, \.npz or \.npy"):
        build(cfg_for(name="tensors", path=str(tmp_path / "d.csv")))
    np.save(tmp_path / "flat.npy", np.arange(10.0))
    with pytest.raises(DataError, match=r"a \.npy dataset must be 2-D \(samples, features \+ label\); got shape \(10,\)"):
        build(cfg_for(name="tensors", path=str(tmp_path / "flat.npy")))
    np.save(tmp_path / "cube.npy", np.zeros((4, 3, 2)))
    with pytest.raises(DataError, match=r"must be 2-D .* got shape \(4, 3, 2\)"):
        build(cfg_for(name="tensors", path=str(tmp_path / "cube.npy")))
    np.savez(tmp_path / "nolabel.npz", x=np.zeros((10, 2)))
    with pytest.raises(DataError, match=r"expected a mapping with tensors 'x' and 'y'"):
        build(cfg_for(name="tensors", path=str(tmp_path / "nolabel.npz")))
    np.save(tmp_path / "one.npy", np.array([[0.5, 1.0]]))
    with pytest.raises(DataError, match=r"has only 1 samples: too few to hold out a validation set"):
        build(cfg_for(name="tensors", path=str(tmp_path / "one.npy")))



@pytest.mark.parametrize("name", ["bad.pt", "bad.npy", "bad.npz"])
def test_unreadable_tensor_file_is_a_data_error(tmp_path, name):
    (tmp_path / name).write_bytes(b"not a tensor file")
    with pytest.raises(DataError, match=name):
        build(cfg_for(name="tensors", path=str(tmp_path / name)))

def test_unknown_source_name():
    with pytest.raises(DataError, match=r"data.name = 'csv' is not one of: stdlib-text, text, digits"):
        build(cfg_for(name="csv"))


# --------------------------------------------------------------------------- step loader


def _loader_parts(n=40, global_batch=8, seed=3):
    x = torch.arange(n, dtype=torch.float32)[:, None]
    return Tensors(x, torch.arange(n)), GlobalBatchSampler(n, global_batch, seed)


def _as_lists(batches):
    return [[(x.tolist(), y.tolist()) for x, y in step] for step in batches]


@pytest.mark.parametrize("prefetch", [1, 2, 5])
def test_prefetch_yields_the_same_batches(prefetch):
    ds, sampler = _loader_parts()
    ref = _as_lists(StepLoader(ds, sampler, 2, 12, dp_rank=1, dp=2, micro=2, prefetch=0))
    got = _as_lists(StepLoader(ds, sampler, 2, 12, dp_rank=1, dp=2, micro=2, prefetch=prefetch))
    assert got == ref
    assert len(ref) == 10 and all(len(step) == 2 for step in ref)  # 8 / 2 ranks = 4 samples = 2 micro-batches


def test_loader_batches_are_this_ranks_slice_of_the_global_batch():
    ds, sampler = _loader_parts()
    per_rank = [list(StepLoader(ds, sampler, 0, 6, dp_rank=r, dp=2, micro=2, prefetch=1)) for r in range(2)]
    for step in range(6):
        ys = torch.cat([y for r in range(2) for _, y in per_rank[r][step]])
        assert torch.equal(ys, sampler.global_batch(step))
        for r in range(2):
            for x, y in per_rank[r][step]:
                assert torch.equal(x[:, 0].long(), y)


class _FailingFetch:
    """Fails on the `fail_on`-th fetch call (1-based)."""

    def __init__(self, dataset, fail_on: int):
        self.dataset, self.fail_on, self.calls = dataset, fail_on, 0

    def fetch(self, idx):
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError(f"boom at call {self.calls}")
        return self.dataset.fetch(idx)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_fetch_errors_surface_in_the_consumer(prefetch):
    ds, sampler = _loader_parts()
    loader = StepLoader(_FailingFetch(ds, fail_on=4), sampler, 0, 10, dp_rank=0, dp=1, micro=8, prefetch=prefetch)
    got = []
    with pytest.raises(RuntimeError, match="boom at call 4"):
        for step in loader:
            got.append(step)
    assert len(got) == 3  # steps 0-2 arrived, then the failure


def test_prefetch_thread_stops_when_the_consumer_stops():
    ds, sampler = _loader_parts()
    before = set(threading.enumerate())
    it = iter(StepLoader(ds, sampler, 0, 1000, dp_rank=0, dp=1, micro=4, prefetch=2))
    next(it)
    workers = [t for t in threading.enumerate() if t not in before and t.name == "plait-prefetch"]
    assert len(workers) == 1
    it.close()
    workers[0].join(timeout=5)
    assert not workers[0].is_alive()


def test_loader_is_layout_independent():
    ds, sampler = _loader_parts(n=48, global_batch=12)

    def samples(dp, micro):
        loaders = [StepLoader(ds, sampler, 0, 5, dp_rank=r, dp=dp, micro=micro, prefetch=0) for r in range(dp)]
        steps = zip(*[list(lo) for lo in loaders])
        return [torch.cat([y for rank in step for _, y in rank]).tolist() for step in steps]

    ref = samples(1, 12)
    assert ref == [sampler.global_batch(s).tolist() for s in range(5)]
    assert samples(2, 3) == ref and samples(3, 2) == ref and samples(4, 1) == ref



def test_the_stdlib_corpus_is_tokenized_once_then_read_from_the_cache(tmp_path, monkeypatch):
    """A cached corpus is the tokenized one exactly; a torn cache file is rebuilt; a changed split is its own entry."""
    from plait.data import sources

    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path))
    cfg = cfg_for(name="stdlib-text")
    built = build(cfg)
    (entry,) = tmp_path.glob("stdlib-text-*.npz")
    calls = []
    monkeypatch.setattr(sources, "_read", lambda files: calls.append(len(files)) or "")  # a cache miss would read
    cached = build(cfg)
    assert calls == [] and cached.tokenizer.chars == built.tokenizer.chars
    assert cached.unigram_val_loss == built.unigram_val_loss and cached.spec == built.spec
    for part in ("train", "val"):
        assert torch.equal(getattr(cached, part).tokens, getattr(built, part).tokens)
    monkeypatch.undo()
    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path))
    entry.write_bytes(entry.read_bytes()[:1000])  # a write cut short (a full disk, a killed process)
    again = build(cfg)
    assert torch.equal(again.train.tokens, built.train.tokens) and entry.stat().st_size > 1000
    build(cfg_for(name="stdlib-text", val_fraction=0.2))
    assert len(list(tmp_path.glob("stdlib-text-*.npz"))) == 2 and not list(tmp_path.glob(".*.tmp"))


def test_text_documents_restart_positions_at_each_file_and_each_window():
    """data.pack = true on text: DocumentWindows' positions count from each document's first token, or the window's."""
    from plait.data.datasets import DocumentWindows

    windows = DocumentWindows(np.arange(40), np.array([0, 6, 13, 14]), context=8)
    x, y = windows.fetch(torch.tensor([0, 1, 3]))
    assert torch.equal(x[:, 0], torch.tensor([list(range(8)), list(range(8, 16)), list(range(24, 32))]))
    assert x[:, 1].tolist() == [[0, 1, 2, 3, 4, 5, 0, 1],  # a document starts at 6
                                [0, 1, 2, 3, 4, 0, 0, 1],  # the window at 8; documents at 13 and 14
                                [0, 1, 2, 3, 4, 5, 6, 7]]  # inside the last document: from the window's start
    assert torch.equal(y, x[:, 0] + 1)
