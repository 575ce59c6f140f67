"""data.mix (mixup, cutmix) and train.loss = "focal": each against its formula, seeded per (seed, sample, epoch),
and a dp=2 run with both on the one-process trajectory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import params_after, rank0_params, step_losses
from plait.config import load_config
from plait.data.datasets import Tensors
from plait.data.mix import Mixed
from plait.errors import ConfigError, DataError
from plait.train.loss import focal_loss


def _images(n=10):
    g = torch.Generator().manual_seed(0)
    return Tensors(torch.rand(n, 1, 8, 8, generator=g), torch.arange(n) % 3)


def test_mixup_blends_two_samples_and_their_labels_by_one_seeded_weight():
    data = _images()
    m = Mixed(data, "mixup", 0.4, 3, seed=7)
    idx, epochs = torch.tensor([2, 5]), torch.tensor([0, 1])
    x, y = m.fetch_epoch(idx, epochs)
    for k, (i, e) in enumerate([(2, 0), (5, 1)]):
        j, lam, _ = m.draw(i, e)
        torch.testing.assert_close(x[k], lam * data.x[i] + (1 - lam) * data.x[j])
        want = lam * F.one_hot(data.y[i], 3).float() + (1 - lam) * F.one_hot(data.y[j], 3).float()
        torch.testing.assert_close(y[k], want)
    assert m.draw(2, 0) == Mixed(data, "mixup", 0.4, 3, seed=7).draw(2, 0) != m.draw(2, 1)  # (seed, sample, epoch)
    x2, _ = m.fetch_epoch(torch.tensor([5]), torch.tensor([1]))
    assert torch.equal(x2[0], x[1])  # the same whichever batch takes it
    assert torch.equal(m.fetch(idx)[0], data.x[idx])  # validation is not mixed


def test_cutmix_pastes_a_box_and_the_label_weight_is_the_area_left():
    data = _images()
    m = Mixed(data, "cutmix", 1.0, 3, seed=3)
    x, y = m.fetch_epoch(torch.arange(10), torch.zeros(10, dtype=torch.long))
    for k in range(10):
        j, _, _ = m.draw(k, 0)
        from_j = (x[k] == data.x[j]) & (x[k] != data.x[k])
        lam = 1 - float(from_j.float().mean())  # the share of sample k's own pixels left
        if data.y[k] != data.y[j]:
            assert float(y[k, data.y[k]]) == pytest.approx(lam, abs=1e-6)
        assert torch.all((x[k] == data.x[k]) | (x[k] == data.x[j]))  # every pixel is one of the two
        assert float(y[k].sum()) == pytest.approx(1.0)


def test_focal_loss_is_its_formula_and_cross_entropy_at_gamma_0():
    g = torch.Generator().manual_seed(1)
    logits, y = torch.randn(6, 5, generator=g), torch.tensor([0, 1, 4, 2, 2, 3])
    torch.testing.assert_close(focal_loss(0.0)(logits, y), F.cross_entropy(logits, y))
    p = logits.softmax(-1)[torch.arange(6), y]
    torch.testing.assert_close(focal_loss(2.0)(logits, y), (-(1 - p) ** 2 * p.log()).mean())
    soft = F.one_hot(y, 5).float()
    torch.testing.assert_close(focal_loss(2.0)(logits, soft), focal_loss(2.0)(logits, y))  # one-hot = hard
    lm = torch.randn(2, 3, 5, generator=g)
    torch.testing.assert_close(focal_loss(0.0)(lm, y.view(2, 3)), F.cross_entropy(lm.flatten(0, 1), y))


def _digits(*sets):
    return load_config(None, ["model.name=cnn", "data.name=digits", "model.width=8", "train.global_batch_size=16",
                              "train.micro_batch_size=8", "train.steps=6", "train.eval_every=0", "train.eval_samples=64",
                              "checkpoint.every=0", "log.every=1", "log.progress=false", "log.report=false",
                              "optim.name=sgd", "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0",
                              "optim.warmup_steps=0", "optim.lr=0.2", "optim.schedule=constant", *sets])



def test_a_mixed_focal_run_at_dp2_is_the_one_process_run(pool2, tmp_path):
    # cutmix (mixup's partner and weight are drawn by the same code, tested against its formula above)
    sets = ("data.mix='cutmix'", "data.mix_alpha=0.4", "train.loss='focal'", "train.focal_gamma=1.5")
    one = params_after(_digits("parallel.dp=1", *sets), tmp_path / "one")
    two = pool2.run(rank0_params, _digits("parallel.dp=2", *sets), tmp_path / "two")[0]
    for (l1, g1), (l2, g2) in zip(step_losses(tmp_path / "one"), step_losses(tmp_path / "two"), strict=True):
        assert l2 == pytest.approx(l1, rel=1e-5) and g2 == pytest.approx(g1, rel=1e-5)
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5


def test_what_cannot_mix_or_focus_is_named(tiny_text, tmp_path):
    from helpers import tiny_gpt_config

    with pytest.raises(DataError) as e:
        params_after(tiny_gpt_config(tiny_text, "parallel.dp=1", "data.mix='mixup'"), tmp_path / "a")
    assert str(e.value) == ("data.mix = 'mixup' mixes the labels of a classification task without class weights; this "
                            "data's task is 'lm': set data.mix='none'")
    with pytest.raises(DataError, match="data.mix = 'cutmix' pastes boxes between images"):
        params_after(load_config(None, ["model.name=mlp", "data.name=synthetic", "parallel.dp=1", "data.mix='cutmix'"]),
                     tmp_path / "b")
    with pytest.raises(ConfigError, match="train.loss = 'focal' is for classification and language models"):
        params_after(load_config(None, ["model.name=deepfm", "data.name=clicks", "parallel.dp=1", "train.loss='focal'"]),
                     tmp_path / "c")
