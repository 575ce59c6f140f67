"""data.sampler = "balanced" and data.class_weights = "balanced": still a function of (seed, step), layout-independent."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from plait.config import load_config
from plait.data import build_data
from plait.data.loader import StepLoader
from plait.data.packed import pack
from plait.data.sampler import BalancedBatchSampler, balanced_class_weights
from plait.data.sources import labels_of
from plait.errors import DataError
from plait.train.loss import loss_for

LABELS = torch.tensor([0] * 90 + [1] * 10)


def test_balanced_sampler_is_a_function_of_seed_and_step_and_balances_classes():
    a, b = BalancedBatchSampler(LABELS, 50, seed=3), BalancedBatchSampler(LABELS, 50, seed=3)
    assert torch.equal(a.global_batch(7), b.global_batch(7))
    assert not torch.equal(a.global_batch(7), a.global_batch(8))
    assert not torch.equal(a.global_batch(7), BalancedBatchSampler(LABELS, 50, seed=4).global_batch(7))
    drawn = torch.cat([a.global_batch(s) for s in range(200)])
    share = float((LABELS[drawn] == 1).float().mean())
    assert 0.47 < share < 0.53  # 10 % of the data, half of every batch


def test_balanced_class_weights_by_hand():
    assert balanced_class_weights(LABELS, 2) == [pytest.approx(100 / 180), pytest.approx(5.0)]
    assert balanced_class_weights(LABELS, 3) == [pytest.approx(100 / 270), pytest.approx(100 / 30), 0.0]  # an empty class


def test_weighted_loss_is_a_mean_over_samples():
    spec = build_data(load_config(None, ["data.name='digits'", "data.class_weights='balanced'"]).data, None).spec
    w = torch.tensor(spec.class_weights)
    assert len(w) == 10 and 0.9 < float(w.min()) and float(w.max()) < 1.1  # digits are nearly balanced
    logits, y = torch.randn(6, 10), torch.tensor([0, 1, 2, 3, 3, 9])
    by_hand = sum(float(w[y[i]]) * float(F.cross_entropy(logits[i:i + 1], y[i:i + 1])) for i in range(6)) / 6
    assert float(loss_for(spec)(logits, y)) == pytest.approx(by_hand, rel=1e-6)
    # halves of the batch, each scaled by its share, add up to the whole: the layout-independence condition
    halves = 0.5 * loss_for(spec)(logits[:3], y[:3]) + 0.5 * loss_for(spec)(logits[3:], y[3:])
    assert float(halves) == pytest.approx(by_hand, rel=1e-6)


def test_labels_of_every_source_kind(tmp_path):
    cfg = load_config(None, ["data.name='digits'"])
    b = build_data(cfg.data, None)
    pack(b, tmp_path / "p", shard_bytes=1 << 16)
    p = build_data(load_config(None, ["data.name='packed'", f"data.path='{tmp_path / 'p'}'"]).data, None)
    assert torch.equal(labels_of(p.train), labels_of(b.train)) and torch.equal(labels_of(b.train), b.train.y)
    assert json.loads((tmp_path / "p" / "plait.json").read_text())["labels"]["val"] == b.val.y.tolist()
    with pytest.raises(DataError, match="need class labels"):
        labels_of(object())
    with pytest.raises(DataError, match="is a 'binary' task"):
        build_data(load_config(None, ["data.name='clicks'", "data.class_weights='balanced'",
                                      "data.synthetic_samples=100"]).data, None)


def _imbalanced(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 6, generator=g)
    y = (x[:, 0] > 1.0).long()  # ~16 % class 1
    torch.save({"x": x, "y": y}, tmp_path / "imb.pt")
    return ["model.name='mlp'", "model.width=16", "model.depth=1", "data.name='tensors'", f"data.path='{tmp_path / 'imb.pt'}'",
            "data.sampler='balanced'", "data.class_weights='balanced'", "train.global_batch_size=32",
            "train.micro_batch_size=8", "optim.name='sgd'", "optim.lr=0.3", "optim.momentum=0", "optim.weight_decay=0",
            "optim.grad_clip=0", "optim.warmup_steps=0", "optim.schedule='constant'", "train.steps=4", "log.every=1",
            "log.progress=false", "log.report=false", "train.sample_tokens=0", "checkpoint.every=2",
            "train.eval_samples=30", "train.eval_batch_size=10", "parallel.dp=1"]


def _losses(run):
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_balanced_training_is_layout_independent_and_resumes(tmp_path, pool2):
    from test_packed import _diff, _rank0

    from helpers import params_after

    base = _imbalanced(tmp_path)
    ref = params_after(load_config(None, base), tmp_path / "one")
    two = pool2.run(_rank0, load_config(None, [*base, "parallel.dp=2"]), tmp_path / "two")[0]
    assert _diff(two, ref) < 1e-6
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-6)
    params_after(load_config(None, [*base, "train.stop_after=2"]), tmp_path / "r")
    resumed = params_after(load_config(None, base), tmp_path / "r", resume=True)
    assert _diff(resumed, ref) == 0.0
    plain = params_after(load_config(None, [*base, "data.sampler='shuffle'", "data.class_weights='none'"]), tmp_path / "p")
    assert _diff(plain, ref) > 1e-3  # the remedies change the trajectory


def test_loader_slices_the_balanced_batch():
    s = BalancedBatchSampler(LABELS, 12, seed=1)
    ds = type("D", (), {"fetch": lambda self, i: (i[:, None].float(), i), "__len__": lambda self: 100})()
    got = [torch.cat([y for r in range(3) for _, y in list(StepLoader(ds, s, 0, 4, r, 3, 2, prefetch=0))[k]])
           for k in range(4)]
    assert all(torch.equal(g, s.global_batch(k)) for k, g in enumerate(got))
