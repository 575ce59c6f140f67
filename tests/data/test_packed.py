"""Packed shards (LitData) keep plait's contract: the same trajectory as the data in memory, at dp = 1 and 2, and
across a resume at another world size; bad shards are errors naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import params_after
from plait.config import load_config
from plait.data import build_data
from plait.data.packed import pack, parse_size
from plait.errors import DataError

STEPS = 4
SGD = ("optim.name='sgd'", "optim.lr=0.3", "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0",
       "optim.schedule='constant'", "optim.warmup_steps=0", "log.every=1", f"train.steps={STEPS}", "checkpoint.every=2",
       "parallel.dp=1")
MLP = ("model.name='mlp'", "data.name='digits'", "model.width=32", "model.depth=1", "train.global_batch_size=64",
       "train.micro_batch_size=16", "train.sample_tokens=0", "log.progress=false", "log.report=false",
       "train.eval_samples=100", "train.eval_batch_size=50")


@pytest.fixture(scope="module")
def packed_digits(tmp_path_factory) -> Path:
    cfg = load_config(None, list(MLP))
    out = tmp_path_factory.mktemp("packed") / "digits"
    pack(build_data(cfg.data, cfg.model), out, shard_bytes=parse_size("32KB"))  # several shards
    return out


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _rank0(cfg, run_dir, resume=False):
    import torch.distributed as dist

    params = params_after(cfg, run_dir, resume)
    return params if dist.get_rank() == 0 else None


def _diff(a, b) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_pack_writes_shards_and_reads_back_the_same_samples(packed_digits):
    meta = json.loads((packed_digits / "plait.json").read_text())
    assert meta["sizes"] == {"train": 1618, "val": 179}
    assert len(list((packed_digits / "train").glob("chunk-*.bin"))) >= 4
    mem = build_data(load_config(None, list(MLP)).data, None)
    packed = build_data(load_config(None, [*MLP, "data.name='packed'", f"data.path='{packed_digits}'"]).data, None)
    assert packed.spec == mem.spec and len(packed.train) == len(mem.train) and len(packed.val) == len(mem.val)
    idx = torch.tensor([0, 1617, 5, 900, 5])
    for a, b in zip(packed.train.fetch(idx), mem.train.fetch(idx)):
        assert torch.equal(a, b)
    assert torch.equal(packed.train.source_index, mem.train.source_index)


def test_packed_trains_to_the_weights_of_the_data_in_memory(packed_digits, pool2, tmp_path):
    mem_cfg = load_config(None, [*MLP, *SGD])
    packed = [*MLP, *SGD, "data.name='packed'", f"data.path='{packed_digits}'"]
    ref = params_after(mem_cfg, tmp_path / "mem")
    one = params_after(load_config(None, packed), tmp_path / "p1")
    two = pool2.run(_rank0, load_config(None, [*packed, "parallel.dp=2"]), tmp_path / "p2")[0]
    assert _losses(tmp_path / "p1") == _losses(tmp_path / "mem")  # dp = 1: bit for bit
    assert _diff(one, ref) == 0.0
    assert _losses(tmp_path / "p2") == pytest.approx(_losses(tmp_path / "mem"), rel=1e-6)
    assert _diff(two, ref) < 1e-6
    # stop a dp = 2 packed run after step 2, resume it in one process: the same trajectory
    pool2.run(_rank0, load_config(None, [*packed, "parallel.dp=2", "train.stop_after=2"]), tmp_path / "r")
    after = params_after(load_config(None, packed), tmp_path / "r", resume=True)
    assert _diff(after, ref) < 1e-6
    assert _losses(tmp_path / "r") == pytest.approx(_losses(tmp_path / "mem"), rel=1e-6)


def test_pack_refuses_a_non_empty_folder_and_tiny_shards(tmp_path):
    cfg = load_config(None, list(MLP))
    bundle = build_data(cfg.data, cfg.model)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    with pytest.raises(DataError, match="not an empty folder"):
        pack(bundle, tmp_path / "x")
    with pytest.raises(DataError, match="too small"):
        pack(bundle, tmp_path / "y", shard_bytes=100)
    with pytest.raises(DataError, match="not a size"):
        parse_size("lots")
    assert parse_size("64MB") == 64 << 20 and parse_size("1.5KB") == 1536


def _copy(src: Path, tmp: Path) -> Path:
    dst = tmp / "copy"
    shutil.copytree(src, dst)
    return dst


def _load(path: Path, *extra):
    return build_data(load_config(None, [*MLP, "data.name='packed'", f"data.path='{path}'", *extra]).data, None)


def test_truncated_shard_is_an_error_naming_it(packed_digits, tmp_path):
    d = _copy(packed_digits, tmp_path)
    shard = sorted((d / "train").glob("chunk-*.bin"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(DataError, match=f"shard {shard}.*truncated or corrupt"):
        _load(d)


def test_missing_shard_and_wrong_count_are_index_mismatches(packed_digits, tmp_path):
    d = _copy(packed_digits, tmp_path)
    sorted((d / "val").glob("chunk-*.bin"))[0].unlink()
    with pytest.raises(DataError, match="index does not match its shards"):
        _load(d)
    d2 = _copy(packed_digits, tmp_path / "b")
    meta = json.loads((d2 / "plait.json").read_text())
    meta["sizes"]["train"] += 1
    (d2 / "plait.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="holds 1618 samples but .*plait.json says 1619"):
        _load(d2)


def _set_config(d: Path, **config) -> None:
    index = json.loads((d / "train" / "index.json").read_text())
    index["config"].update(config)
    (d / "train" / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("fmt", ["pickle", "str:pickle", "numpy:pickle", "no_header_numpy:pickle", "graph", "video",
                                 "tensor"])
def test_a_field_format_plait_does_not_write_is_refused(packed_digits, tmp_path, fmt):
    d = _copy(packed_digits, tmp_path)
    _set_config(d, data_format=["numpy", fmt])
    with pytest.raises(DataError) as e:
        _load(d)
    assert str(e.value) == (f"{d / 'train' / 'index.json'} declares a field of format {fmt!r}; plait reads only the "
                            "formats it writes (numpy arrays, image bytes), never a pickled or decoded one: re-pack it "
                            "with `plait data pack`")


@pytest.mark.parametrize("config, words", [
    ({"item_loader": "TokensLoader"}, "uses item loader 'TokensLoader'"),
    ({"encryption": {"kind": "fernet"}}, "and encryption \"{'kind': 'fernet'}\""),
    ({"data_spec": '[1, {"type": "collections.OrderedDict", "children_spec": []}]'}, "names type 'collections."),
])
def test_an_item_loader_encryption_or_pytree_type_plait_does_not_write_is_refused(packed_digits, tmp_path, config,
                                                                                  words):
    d = _copy(packed_digits, tmp_path)
    _set_config(d, **config)
    with pytest.raises(DataError, match="re-pack it with `plait data pack`") as e:
        _load(d)
    assert words in str(e.value)


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_shard_that_would_unpickle_is_refused_before_litdata_reads_it(packed_digits, tmp_path):
    from litdata import StreamingDataset
    from litdata.streaming.writer import BinaryWriter

    with pytest.raises(DataError, match="no plait.json"):
        _load(tmp_path)
    d, marker = _copy(packed_digits, tmp_path), tmp_path / "ran"
    shutil.rmtree(d / "train")
    w = BinaryWriter(str(d / "train"), chunk_bytes=1 << 16)
    for i in range(4):
        w[i] = {"x": _Payload(str(marker)), "y": torch.zeros(1).numpy()}
    w.done()
    w.merge()
    _set_config(d, data_format=["str:pickle" if f == "pickle" else f
                                for f in json.loads((d / "train" / "index.json").read_text())["config"]["data_format"]])
    meta = json.loads((d / "plait.json").read_text())
    meta["sizes"]["train"] = 4
    (d / "plait.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="declares a field of format 'str:pickle'"):
        _load(d)
    assert not marker.exists()
    StreamingDataset(str(d / "train"))[0]  # LitData itself runs it: the replay is a real attack
    assert marker.exists()


def test_corrupt_sample_is_an_error_or_skipped_and_counted(packed_digits, tmp_path):
    d = _copy(packed_digits, tmp_path)
    shard = sorted((d / "train").glob("chunk-*.bin"))[0]
    data = bytearray(shard.read_bytes())
    data[-400:] = b"\xff" * 400  # the same size: only reading the samples finds it
    shard.write_bytes(bytes(data))
    bundle = _load(d)
    n = int(json.loads((d / "train" / "index.json").read_text())["chunks"][0]["chunk_size"])
    bad = next(i for i in range(n) if _unreadable(bundle.train, i))
    with pytest.raises(DataError, match=f"{shard}: sample {bad} cannot be read"):
        bundle.train.fetch(torch.tensor([bad]))
    skipping = _load(d, "data.on_bad_sample='skip'")
    x, y = skipping.train.fetch(torch.tensor([0, bad]))
    assert skipping.train.skipped >= 1 and x.shape == (2, 1, 8, 8)


def _unreadable(ds, i) -> bool:
    try:
        ds.raw(i)
        return False
    except DataError:
        return True


def test_cli_pack_names_the_source_and_refuses_a_missing_one(tmp_path, capsys):
    from plait.audit.commands import source_overrides
    from plait.cli import main

    arr = torch.cat([torch.randn(40, 3), torch.randint(0, 2, (40, 1)).float()], 1).numpy()
    import numpy as np

    np.save(tmp_path / "t.npy", arr)
    assert main(["data", "pack", str(tmp_path / "t.npy"), "-o", str(tmp_path / "p"), "--shard-size", "4KB"]) == 0
    assert "packed tensors (36 train + 4 validation samples)" in capsys.readouterr().out
    x, _ = _load(tmp_path / "p").train.fetch(torch.arange(36))
    assert x.shape == (36, 3)
    assert main(["data", "pack", str(tmp_path / "nope"), "-o", str(tmp_path / "q")]) == 2
    assert "neither a source name" in capsys.readouterr().err
    assert source_overrides("digits") == ["data.name='digits'"]


@pytest.mark.slow
def test_a_corrupt_sample_on_one_rank_ends_the_whole_job_with_its_name(packed_digits, tmp_path):
    """dp = 2 under the launcher: the rank that reads the bad sample fails, the other is stopped: no hang."""
    import time

    from helpers import plait

    d = _copy(packed_digits, tmp_path)
    shard = sorted((d / "train").glob("chunk-*.bin"))[0]
    data = bytearray(shard.read_bytes())
    data[-400:] = b"\xff" * 400
    shard.write_bytes(bytes(data))
    t0 = time.monotonic()
    r = plait("train", "--set", "model.name=mlp", "--set", "data.name=packed", "--set", f"data.path={d}", "--set",
              "parallel.dp=2", "--set", "train.steps=60", "--set", "train.global_batch_size=64", "--set",
              "train.micro_batch_size=32", "--set", "log.progress=false", "--set", "log.report=false", "--set",
              "launch.timeout_s=60", "--out", tmp_path / "run", timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"error: {shard}: sample" in r.stderr and "the shard is corrupt" in r.stderr
    assert time.monotonic() - t0 < 45  # well inside launch.timeout_s: the other rank did not wait for a collective


def test_packed_text_trains_a_gpt_like_the_text_and_model_checks_see_the_source(tiny_text, tmp_path):
    from helpers import TINY_GPT, max_diff
    from plait.config import load_config as load
    from plait.errors import ConfigError
    from plait.train.job import check_job

    text = [*TINY_GPT, "data.name='text'", f"data.path='{tiny_text}'", "train.steps=2", "parallel.dp=1",
            "checkpoint.every=0"]
    cfg = load(None, text)
    pack(build_data(cfg.data, cfg.model), tmp_path / "p", shard_bytes=parse_size("16KB"))
    packed = [*text, "data.name='packed'", f"data.path='{tmp_path / 'p'}'"]
    assert max_diff(params_after(cfg, None), params_after(load(None, packed), None)) == 0.0
    with pytest.raises(DataError, match="packed with model.context = 32"):
        build_data(load(None, [*packed, "model.context=16"]).data, load(None, [*packed, "model.context=16"]).model)
    with pytest.raises(ConfigError, match="model.name = 'mlp' cannot train on data.name = 'text'"):
        check_job(load(None, [*packed, "model.name='mlp'"]))


def test_text_documents_packed_into_shards_read_back_with_their_positions(tiny_text, tmp_path):
    """data.pack = true on text, then `plait data pack`: the shards hold rows of ids and positions (each file a
    document), read back as written, and the spec says the rows are packed."""
    from helpers import TINY_GPT
    from plait.config import load_config as load

    cfg = load(None, [*TINY_GPT, "data.name='text'", f"data.path='{tiny_text}'", "data.pack=true"])
    bundle = build_data(cfg.data, cfg.model)
    pack(bundle, tmp_path / "p", shard_bytes=parse_size("64KB"))
    back = build_data(*(lambda c: (c.data, c.model))(load(None, [*TINY_GPT, "data.name='packed'",
                                                                  f"data.path='{tmp_path / 'p'}'"])))
    idx = torch.arange(len(bundle.train))
    (x, y), (bx, by) = bundle.train.fetch(idx), back.train.fetch(idx)
    assert x.shape == (len(idx), 2, 32) and torch.equal(bx, x) and torch.equal(by, y) and back.spec.packed
    inside = [int(s) for s in bundle.train.starts[1:] if s % 32 and s < 32 * len(idx)]  # files beginning inside a row
    assert inside and int((x[:, 1, 1:] == 0).sum()) == len(inside)
