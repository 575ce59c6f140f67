"""data.augment = ["randaugment"]: each operation against its formula, magnitude 0 changes nothing, seeded per
(seed, sample, epoch), a key plait tune can search, and a dp=2 run on the one-process trajectory."""

from __future__ import annotations

import pytest
import torch

from helpers import params_after, rank0_params, step_losses
from plait.config import load_config
from plait.data.augment import Augmented
from plait.data.datasets import Tensors
from plait.data.randaugment import OPS, apply
from plait.tune.space import read_space


def _img():
    return torch.rand(1, 10, 10, generator=torch.Generator().manual_seed(0))


def test_magnitude_0_changes_nothing_and_the_pixel_operations_are_their_formulas():
    x = _img()
    for op in OPS:
        for sign in (1.0, -1.0):
            assert torch.equal(apply(op, x, 0.0, sign), x), op
    torch.testing.assert_close(apply("brightness", x, 0.5, -1.0), x * (1 - 0.45))
    torch.testing.assert_close(apply("contrast", x, 0.5, 1.0), x.mean() + (x - x.mean()) * 1.45)
    top = x.max()
    torch.testing.assert_close(apply("solarize", x, 0.3, 1.0), torch.where(x > 0.7 * top, top - x, x))


def test_translation_moves_the_image_by_its_share_of_the_size():
    x = _img()
    y = apply("translate_x", x, 1.0, 1.0)  # 0.3 of 10 pixels: 3, zeros where the image left
    torch.testing.assert_close(y[..., :7], x[..., 3:], rtol=0, atol=1e-6)
    assert torch.equal(y[..., 7:], torch.zeros(1, 10, 3))
    y = apply("translate_y", x, 1.0, -1.0)
    torch.testing.assert_close(y[:, 3:], x[:, :7], rtol=0, atol=1e-6)


def test_rotation_keeps_the_centre_and_the_draws_are_seeded_per_sample_and_epoch():
    x = torch.zeros(1, 9, 9)
    x[0, 4, 4] = 1.0
    assert float(apply("rotate", x, 1.0, 1.0)[0, 4, 4]) == pytest.approx(1.0)
    data = Tensors(torch.rand(4, 1, 10, 10, generator=torch.Generator().manual_seed(2)), torch.arange(4))
    aug = Augmented(data, ["randaugment"], seed=5, noise_std=0.0, rand_n=2, rand_magnitude=7)
    a = aug.fetch_epoch(torch.tensor([1, 2]), torch.tensor([0, 0]))[0]
    b = aug.fetch_epoch(torch.tensor([2]), torch.tensor([0]))[0]
    assert torch.equal(a[1], b[0])  # the same whichever batch takes it
    draws = [aug.fetch_epoch(torch.tensor([2]), torch.tensor([e]))[0] for e in range(6)]
    assert any(not torch.equal(d, draws[0]) for d in draws[1:])  # a new draw each epoch


def test_the_magnitude_is_a_key_plait_tune_can_search(tmp_path):
    (tmp_path / "space.toml").write_text("data.randaugment_magnitude = {int = [0, 10]}\n")
    dims = read_space(tmp_path / "space.toml")
    assert [(d.key, d.kind) for d in dims] == [("data.randaugment_magnitude", "int")]



def test_a_randaugment_run_at_dp2_is_the_one_process_run(pool2, tmp_path):
    def cfg(dp):
        return load_config(None, ["model.name=cnn", "data.name=digits", "model.width=8", f"parallel.dp={dp}",
                                  "train.global_batch_size=16", "train.micro_batch_size=8", "train.steps=5",
                                  "train.eval_every=0", "train.eval_samples=32", "checkpoint.every=0", "log.every=1",
                                  "log.progress=false", "log.report=false", "optim.name=sgd", "optim.momentum=0",
                                  "optim.weight_decay=0", "optim.grad_clip=0", "optim.warmup_steps=0",
                                  "data.augment=['randaugment']", "data.randaugment_magnitude=6"])

    one = params_after(cfg(1), tmp_path / "one")
    two = pool2.run(rank0_params, cfg(2), tmp_path / "two")[0]
    for (l1, g1), (l2, g2) in zip(step_losses(tmp_path / "one"), step_losses(tmp_path / "two"), strict=True):
        assert l2 == pytest.approx(l1, rel=1e-5) and g2 == pytest.approx(g1, rel=1e-5)
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5
