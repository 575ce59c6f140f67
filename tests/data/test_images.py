"""Image folders: decoding, bad files, packing, parallel decoding in worker processes and seeded augmentation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import params_after
from plait.config import load_config
from plait.data import build_data
from plait.data.augment import Augmented
from plait.data.loader import StepLoader
from plait.data.packed import pack
from plait.data.sampler import GlobalBatchSampler
from plait.errors import DataError


def make_images(root: Path, classes: int = 3, per: int = 12, size: int = 12) -> Path:
    """`classes` folders of `per` small images each: a class colour plus noise; every third one a JPEG."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per):
            base = np.zeros((size, size, 3))
            base[..., c % 3] = 200
            arr = np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)
            ext = "jpg" if i % 3 == 0 else "png"
            Image.fromarray(arr).save(root / f"class{c}" / f"{i:03d}.{ext}")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("imgs") / "data")


IMG = ("model.name='cnn'", "model.width=8", "model.depth=1", "data.name='images'", "data.image_size=8",
       "data.val_fraction=0.25", "train.global_batch_size=12", "train.micro_batch_size=6", "parallel.dp=1",
       "train.sample_tokens=0", "log.progress=false", "log.report=false", "log.every=1", "train.eval_samples=9",
       "train.eval_batch_size=9", "checkpoint.every=0", "optim.name='sgd'", "optim.lr=0.1", "optim.momentum=0",
       "optim.weight_decay=0", "optim.grad_clip=0", "optim.warmup_steps=0", "optim.schedule='constant'", "train.steps=4")


def _data(path, *extra):
    cfg = load_config(None, [*IMG, f"data.path='{path}'", *extra])
    return build_data(cfg.data, cfg.model)


def test_image_folder_classes_shapes_and_split(folder):
    b = _data(folder)
    assert b.spec.input_shape == [3, 8, 8] and b.spec.num_classes == 3
    assert len(b.train) == 27 and len(b.val) == 9
    x, y = b.train.fetch(torch.arange(27))
    assert x.shape == (27, 3, 8, 8) and 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert torch.bincount(y, minlength=3).sum() == 27
    # each class's colour channel dominates its images
    for c in range(3):
        assert int(x[y == c].mean((0, 2, 3)).argmax()) == c
    src = torch.cat([b.train.source_index, b.val.source_index]).sort().values
    assert torch.equal(src, torch.arange(36))


def test_empty_class_folder_and_too_few_classes_name_the_folder(folder, tmp_path):
    d = make_images(tmp_path / "d", classes=2, per=4)
    (d / "empty").mkdir()
    with pytest.raises(DataError, match=f"class folder {d / 'empty'} has no images"):
        _data(d)
    one = make_images(tmp_path / "one", classes=1, per=4)
    with pytest.raises(DataError, match="1 class folder"):
        _data(one)


def test_undecodable_image_is_an_error_naming_it_or_skipped_and_counted(tmp_path):
    d = make_images(tmp_path / "d", classes=2, per=6)
    bad = d / "class1" / "001.png"
    bad.write_bytes(b"not a png at all")
    b = _data(d, "data.val_fraction=0.1")
    i = [str(f) for f in b.train.files].index(str(bad))
    with pytest.raises(DataError, match=f"{bad} cannot be decoded as an image.*data.on_bad_sample='skip'"):
        b.train.fetch(torch.tensor([i]))
    s = _data(d, "data.val_fraction=0.1", "data.on_bad_sample='skip'")
    x, y = s.train.fetch(torch.tensor([i, i]))
    nxt, ny = s.train.fetch(torch.tensor([i + 1]))
    assert s.train.skipped == 2 and torch.equal(x[0], nxt[0]) and int(y[0]) == int(ny[0])  # the next sample instead


def test_packed_images_decode_to_the_same_tensors(folder, tmp_path):
    b = _data(folder)
    pack(b, tmp_path / "p", shard_bytes=4096)
    p = _data(tmp_path / "p", "data.name='packed'")
    assert p.spec == b.spec and json.loads((tmp_path / "p" / "plait.json").read_text())["kind"] == "images"
    idx = torch.tensor([3, 0, 26, 3])
    for a, c in zip(p.train.fetch(idx), b.train.fetch(idx)):
        assert torch.equal(a, c)
    assert torch.equal(p.train.source_index, b.train.source_index)


def _steps(dataset, n, dp, micro, workers=0, steps=6, batch=12):
    sampler = GlobalBatchSampler(n, batch, seed=5)
    per_rank = [list(StepLoader(dataset, sampler, 0, steps, r, dp, micro, prefetch=1, workers=workers))
                for r in range(dp)]
    return [torch.cat([x for rank in range(dp) for x, _ in per_rank[rank][s]]) for s in range(steps)]


def test_augmentation_is_layout_independent_and_seeded_per_epoch(folder):
    b = _data(folder)
    aug = Augmented(b.train, ["random_crop", "hflip", "noise"], seed=7, noise_std=0.05)
    ref = _steps(aug, 27, dp=1, micro=12)  # 6 steps of 12 over 27 samples: epochs 0, 1 and 2
    assert all(torch.equal(a, c) for a, c in zip(_steps(aug, 27, dp=2, micro=3), ref))
    assert all(torch.equal(a, c) for a, c in zip(_steps(aug, 27, dp=3, micro=4), ref))
    plain = _steps(b.train, 27, dp=1, micro=12)
    assert all(not torch.equal(a, c) for a, c in zip(ref, plain))  # augmented
    one = torch.tensor([4])
    e0, e1 = aug.fetch_epoch(one, torch.tensor([0])), aug.fetch_epoch(one, torch.tensor([1]))
    assert torch.equal(aug.fetch_epoch(one, torch.tensor([0]))[0], e0[0]) and not torch.equal(e0[0], e1[0])
    assert torch.equal(aug.fetch(one)[0], b.train.fetch(one)[0])  # validation is not augmented


def test_worker_processes_return_the_same_batches_in_order(folder, tmp_path):
    b = _data(folder)
    pack(b, tmp_path / "p", shard_bytes=4096)
    p = _data(tmp_path / "p", "data.name='packed'")
    aug = Augmented(p.train, ["random_crop", "hflip"], seed=3, noise_std=0.0)
    ref = _steps(aug, 27, dp=1, micro=4)
    got = _steps(aug, 27, dp=2, micro=2, workers=2)
    assert all(torch.equal(a, c) for a, c in zip(got, ref))


def test_training_on_images_is_the_same_with_workers_packing_and_augmentation(folder, tmp_path):
    pack(_data(folder), tmp_path / "p", shard_bytes=4096)
    aug = ["data.augment=['random_crop', 'hflip']"]
    ref = params_after(load_config(None, [*IMG, f"data.path='{folder}'", *aug]), tmp_path / "a")
    got = params_after(load_config(None, [*IMG, "data.name='packed'", f"data.path='{tmp_path / 'p'}'", *aug,
                                          "data.workers=2"]), tmp_path / "b")
    assert max(float((ref[k] - got[k]).abs().max()) for k in ref) == 0.0
    plain = params_after(load_config(None, [*IMG, f"data.path='{folder}'"]), tmp_path / "c")
    assert max(float((ref[k] - plain[k]).abs().max()) for k in ref) > 1e-4  # the augmentation took part


def test_augment_config_is_checked():
    from plait.errors import ConfigError

    with pytest.raises(ConfigError, match="'rotate'.*unknown"):
        load_config(None, ["data.augment=['rotate']"])
    with pytest.raises(DataError, match="transforms images"):
        from plait.data.augment import augmented

        cfg = load_config(None, ["data.name='synthetic'", "data.augment=['hflip']"])
        augmented(build_data(cfg.data, cfg.model), cfg.data, 0)


def test_augmented_image_training_at_dp2_equals_one_process(folder, pool2):
    """The rank pool's processes are daemonic: data.workers falls back to the loader's thread, same batches."""
    from test_packed import _diff, _rank0

    base = [*IMG, f"data.path='{folder}'", "data.augment=['random_crop', 'hflip', 'noise']", "data.augment_noise=0.05"]
    ref = params_after(load_config(None, base), None)
    two = pool2.run(_rank0, load_config(None, [*base, "parallel.dp=2", "data.workers=2"]), None)[0]
    assert _diff(two, ref) < 1e-6
