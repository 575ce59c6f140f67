"""A packed dataset several times a memory budget streams through the loader with bounded resident memory."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from helpers import ENV
from plait.data.datasets import Tensors
from plait.data.packed import pack
from plait.data.spec import DataSpec

BUDGET_MB = 48  # resident memory the reader may add on top of the interpreter, torch and LitData

READ = r"""
import json, sys, torch
from types import SimpleNamespace
from plait.data.packed import packed_source
from plait.data.loader import StepLoader
from plait.data.sampler import GlobalBatchSampler

def rss_mb():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024

cfg = SimpleNamespace(name="packed", path=sys.argv[1], on_bad_sample="error")
bundle = packed_source(cfg, SimpleNamespace(context=0))
bundle.train.fetch(torch.tensor([0]))  # LitData's reader and its threads are up: the baseline
base = rss_mb()
with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to now: imports spike above what reading needs
    f.write("5")
n, seen, total = len(bundle.train), 0, 0.0
sampler = GlobalBatchSampler(n, 256, seed=1)
for step in StepLoader(bundle.train, sampler, 0, (n + 255) // 256, 0, 1, 128, prefetch=2):
    for x, y in step:
        seen += len(x)
        total += float(x[:, 0].sum())
peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024
print(json.dumps({"base_mb": base, "peak_mb": peak, "samples": seen}))
"""


def _pack_random(out, n: int, features: int = 4096) -> float:
    """n random float32 samples (incompressible), in 4 MB shards; returns the dataset's size in MB."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    bundle = SimpleNamespace(train=Tensors(x, torch.arange(n) % 10), val=Tensors(x[:8], torch.arange(8)),
                             spec=DataSpec("big", "classification", [features], num_classes=10), tokenizer=None,
                             unigram_val_loss=None, ground_truth_val_loss=None)
    pack(bundle, out, shard_bytes=4 << 20)
    return sum(f.stat().st_size for f in out.rglob("chunk-*.bin")) / 2**20


def _peak(path) -> dict:
    r = subprocess.run([sys.executable, "-c", READ, str(path)], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_peak_rss_is_bounded_and_does_not_grow_with_the_dataset(tmp_path):
    small_mb = _pack_random(tmp_path / "small", 2_000)   # 31 MB
    big_mb = _pack_random(tmp_path / "big", 10_000)      # 156 MB: over 3x the budget
    small, big = _peak(tmp_path / "small"), _peak(tmp_path / "big")
    assert big["samples"] >= 10_000 and big_mb > 3 * BUDGET_MB
    grow_small, grow_big = small["peak_mb"] - small["base_mb"], big["peak_mb"] - big["base_mb"]
    print(f"dataset {small_mb:.0f} MB: peak RSS {small['peak_mb']:.0f} MB (+{grow_small:.0f} over the reader's "
          f"baseline); dataset {big_mb:.0f} MB: peak RSS {big['peak_mb']:.0f} MB (+{grow_big:.0f})")
    assert grow_big < BUDGET_MB
    assert grow_big - grow_small < 16  # 5x the data, about the same memory
