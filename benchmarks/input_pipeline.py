"""Input pipeline: samples/s of plait's loaders against a plain torch DataLoader over the same image folder.

    python benchmarks/input_pipeline.py [--images 1200] [--size 64] [--image-size 32] [--batch 32] [--steps 100]
                                        [--workers 0 1 2] [--augment random_crop hflip] [--out DIR]

Writes an image folder of JPEGs (10 classes; `--images` files of `--size` pixels squared), packs
it with `plait data pack`'s function, then measures, for each worker count, the samples per
second of
  - torch      a plain torch.utils.data.DataLoader over the folder (Pillow decode + resize, the
               same decode plait uses), shuffled, batch `--batch`;
  - folder     plait's StepLoader over data.name = "images" (data.workers = N);
  - packed     plait's StepLoader over the packed shards (data.workers = N);
  - +augment   the same with data.augment = `--augment` (random_crop, hflip), which the others do not do;
and the samples per second of a training step of the default image model (model.name = cnn at
plait's default width and depth, input 3 x image_size^2) on this machine. The verdict says whether
training that model would be input-bound (the best plait loader slower than the step) and by how much.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from plait.config import load_config
from plait.data import build_data
from plait.data.augment import Augmented
from plait.data.images import decode
from plait.data.loader import StepLoader
from plait.data.packed import pack
from plait.data.sampler import GlobalBatchSampler


def make_folder(root: Path, n: int, size: int, classes: int = 10) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(n):
        c = i % classes
        d = root / f"c{c}"
        d.mkdir(parents=True, exist_ok=True)
        arr = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
        Image.fromarray(arr).save(d / f"{i:05d}.jpg", quality=90)
    return root


class FolderDataset(torch.utils.data.Dataset):
    """What a user writes without plait: one file per item, decoded in __getitem__."""

    def __init__(self, files, labels, size):
        self.files, self.labels, self.size = files, labels, size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return decode(self.files[i].read_bytes(), self.size), self.labels[i]


def rate_torch(ds, batch, steps, workers) -> float:
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True,
                                         generator=torch.Generator().manual_seed(0))
    it, seen = iter(loader), 0
    next(it)  # workers started
    t = time.perf_counter()
    for _ in range(steps):
        try:
            x, _ = next(it)
        except StopIteration:
            it = iter(loader)
            x, _ = next(it)
        seen += len(x)
    return seen / (time.perf_counter() - t)


def rate_plait(dataset, batch, steps, workers) -> float:
    sampler = GlobalBatchSampler(len(dataset), batch, seed=0)
    it, seen = iter(StepLoader(dataset, sampler, 0, steps + 1, 0, 1, batch, prefetch=2, workers=workers)), 0
    next(it)
    t = time.perf_counter()
    for step in it:
        seen += sum(len(x) for x, _ in step)
    return seen / (time.perf_counter() - t)


def rate_model(image_size: int, batch: int, steps: int = 10) -> tuple[float, str]:
    from plait.data.spec import DataSpec
    from plait.models import build_model

    cfg = load_config(None, ["model.name='cnn'"])
    spec = DataSpec("images", "classification", [3, image_size, image_size], num_classes=10)
    model = build_model(cfg.model, spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.rand(batch, 3, image_size, image_size), torch.randint(0, 10, (batch,))
    for _ in range(2):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    t = time.perf_counter()
    for _ in range(steps):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    params = sum(p.numel() for p in model.parameters())
    return batch * steps / (time.perf_counter() - t), f"cnn width {cfg.model.width}, depth {cfg.model.depth}, {params:,} params"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1200)
    ap.add_argument("--size", type=int, default=64, help="pixels of the stored JPEGs")
    ap.add_argument("--image-size", type=int, default=32, help="data.image_size: what the model sees")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--augment", nargs="*", default=["random_crop", "hflip"])
    ap.add_argument("--out", type=Path, help="write input_pipeline.json here")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_folder(Path(tmp) / "images", a.images, a.size)
        base = ["data.name='images'", f"data.path='{folder}'", f"data.image_size={a.image_size}", "data.val_fraction=0.05"]
        bundle = build_data(load_config(None, base).data, None)
        pack(bundle, Path(tmp) / "packed", shard_bytes=8 << 20)
        packed = build_data(load_config(None, [*base, "data.name='packed'", f"data.path='{Path(tmp) / 'packed'}'"]).data,
                            None)
        wrap = (lambda d: Augmented(d, a.augment, 0, 0.0)) if a.augment else (lambda d: d)
        plain = FolderDataset(bundle.train.files, bundle.train.labels, a.image_size)
        rows = []
        for w in a.workers:
            rows.append({"workers": w,
                         "torch": rate_torch(plain, a.batch, a.steps, w),
                         "folder": rate_plait(bundle.train, a.batch, a.steps, w),
                         "packed": rate_plait(packed.train, a.batch, a.steps, w),
                         "packed_augment": rate_plait(wrap(packed.train), a.batch, a.steps, w)})
    model_rate, model_desc = rate_model(a.image_size, a.batch)
    best = max(max(r["folder"], r["packed"], r["packed_augment"]) for r in rows)
    bound = best < model_rate
    verdict = (f"INPUT-BOUND: the best plait loader gives {best:,.0f} samples/s, a training step of the default model "
               f"takes {model_rate:,.0f} samples/s; the GPU/CPU would wait {100 * (1 - best / model_rate):.0f} % of the "
               "time: raise data.workers, pack the data, or lower data.image_size"
               if bound else
               f"not input-bound: the best plait loader gives {best:,.0f} samples/s, above the {model_rate:,.0f} samples/s "
               "a training step of the default model takes")
    print(f"{a.images} JPEGs {a.size}x{a.size} -> {a.image_size}x{a.image_size}, batch {a.batch}, augment {a.augment}")
    print(f"{'workers':>7} {'torch DataLoader':>17} {'plait folder':>13} {'plait packed':>13} {'packed+augment':>15}"
          "   (samples/s)")
    for r in rows:
        print(f"{r['workers']:>7} {r['torch']:>17,.0f} {r['folder']:>13,.0f} {r['packed']:>13,.0f} "
              f"{r['packed_augment']:>15,.0f}")
    print(f"model: {model_desc}: {model_rate:,.0f} samples/s per training step (forward, backward, SGD)")
    print(verdict)
    result = {"rows": rows, "model_samples_per_s": model_rate, "model": model_desc, "input_bound": bound,
              "verdict": verdict}
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "input_pipeline.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
