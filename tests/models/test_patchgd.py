"""Patch gradient descent (model.patch_size, model.patch_grad; plait.models.patchgd): the latent is the model's
whole-image answer, the gradient is that of the chosen patches alone, activation memory grows by one patch's worth
per back-propagated patch whatever the canvas, and dp 2 and ZeRO-3 follow the one-process trajectory."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import params_after, rank0_params, step_losses
from plait.config import load_config
from plait.data import build_data
from plait.errors import PlaitError
from plait.models.patchgd import PatchCNN
from plait.train.job import check_job


def _model(grad_patches: int, patch: int = 16) -> PatchCNN:
    torch.manual_seed(0)
    return PatchCNN(1, 8, 2, 10, patch, grad_patches)


def _images(size: int = 64, n: int = 3) -> torch.Tensor:
    return torch.rand(n, 1, size, size, generator=torch.Generator().manual_seed(1))


def test_the_latent_is_the_whole_images_and_the_gradient_the_chosen_patches():
    x, y = _images(), torch.tensor([1, 4, 7])
    m = _model(grad_patches=3)
    m.seed, m.step = 5, 11
    chosen = m.chosen(16)
    other = _model(grad_patches=3)
    other.seed, other.step = 5, 11
    assert len(chosen) == 3 and torch.equal(chosen, other.chosen(16))  # a function of (seed, step)
    other.step = 12
    assert not torch.equal(chosen, other.chosen(16))
    m.eval()
    whole = m(x)
    m.train()
    out = m(x)
    assert torch.allclose(out, whole, atol=1e-6)  # Z holds every patch's vector either way
    torch.nn.functional.cross_entropy(out, y).backward()
    got = {k: p.grad.clone() for k, p in m.named_parameters()}
    # the reference: every patch encoded with gradients, the unchosen ones' vectors detached
    ref = _model(grad_patches=16)
    ref.load_state_dict(m.state_dict())
    patches = x.reshape(3, 1, 4, 16, 4, 16).permute(0, 2, 4, 1, 3, 5).reshape(3, 16, 1, 16, 16)
    z = ref.encode(patches.reshape(48, 1, 16, 16)).reshape(3, 16, -1)
    keep = torch.zeros(16, dtype=torch.bool)
    keep[chosen] = True
    z = torch.where(keep[None, :, None], z, z.detach()).transpose(1, 2).reshape(3, -1, 4, 4)
    torch.nn.functional.cross_entropy(ref.head(ref.mix(z).mean(dim=(2, 3))), y).backward()
    for k, p in ref.named_parameters():
        assert torch.allclose(got[k], p.grad, atol=1e-6), k
    assert got["blocks.0.0.weight"].abs().sum() > 0


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return total[0]


def test_activation_memory_is_one_patchs_worth_per_back_propagated_patch_whatever_the_canvas():
    per_patch = {}
    for size in (64, 128):
        x = _images(size, n=2)
        b = {k: _saved_bytes(_model(k), x) for k in (1, 2, 4)}
        per_patch[size] = b[2] - b[1]
        assert b[4] - b[2] == 2 * per_patch[size] > 0  # linear in the back-propagated patches
        if size == 128:  # 64 patches: the whole-image forward keeps 64 patches' worth (less the index's bytes)
            assert _saved_bytes(_model(64), x) - b[1] == pytest.approx(63 * per_patch[size], rel=1e-3)
    assert per_patch[64] == per_patch[128]  # set by the patch, not the image


def _job(*sets):
    return load_config(None, ["model.name=cnn", "data.name=large-digits", "data.canvas_size=32", "data.digit_scale=2",
                              "model.patch_size=8", "model.patch_grad=3", "model.width=8", "model.depth=1",
                              "train.global_batch_size=8", "train.micro_batch_size=4", "train.steps=5",
                              "train.eval_every=0", "train.eval_samples=32", "checkpoint.every=0", "log.every=1",
                              "log.progress=false", "log.report=false", "optim.name=sgd", "optim.momentum=0",
                              "optim.weight_decay=0", "optim.grad_clip=0", "optim.warmup_steps=0", "optim.lr=0.2",
                              "optim.schedule=constant", *sets])


@pytest.mark.parametrize("layout", [["parallel.dp=2"], ["parallel.dp=2", "parallel.zero=3"]], ids=["dp2", "zero3"])
def test_dp2_and_zero3_follow_the_one_process_trajectory(pool2, tmp_path, layout):
    one = params_after(_job("parallel.dp=1"), tmp_path / "one")
    two = pool2.run(rank0_params, _job(*layout, "train.micro_batch_size=2"), tmp_path / "two")[0]
    a, b = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert len(a) == len(b) == 5
    for (l1, g1), (l2, g2) in zip(a, b):
        assert l2 == pytest.approx(l1, rel=1e-5) and g2 == pytest.approx(g1, rel=1e-5)
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5
    s = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert s["steps"] == 5


def test_large_digits_place_each_digit_whole_on_its_canvas():
    cfg = _job("data.canvas_size=40", "data.digit_scale=3")
    bundle = build_data(cfg.data, cfg.model)
    x, y = bundle.train.fetch(torch.arange(6))
    assert x.shape == (6, 1, 40, 40) and bundle.spec.input_shape == [1, 40, 40]
    again, _ = build_data(cfg.data, cfg.model).train.fetch(torch.arange(6))
    assert torch.equal(x, again)  # placed from the split seed
    for img, small, (top, left) in zip(x, bundle.train.small[:6], bundle.train.at[:6].tolist()):
        rows, cols = img[0].nonzero(as_tuple=True)
        assert top <= rows.min() and rows.max() < top + 24 and left <= cols.min() and cols.max() < left + 24
        assert torch.equal(img[0, top:top + 24:3, left:left + 24:3], small)  # every pixel 3 x 3 times
        assert img.sum().item() == pytest.approx(9 * small.sum().item(), rel=1e-6)  # and nothing else


@pytest.mark.parametrize("sets, message", [
    (["model.patch_size=12"], "model.patch_size = 12 must divide the images' height and width (32 x 32); choose a "
                              "divisor such as 8"),
    (["model.patch_grad=17"], "model.patch_grad = 17: a 32 x 32 image has 16 patches of 8 x 8; choose at most 16 "
                              "(0: every patch)"),
    (["model.name=mlp"], "model.patch_size = 8 is patch gradient descent for model.name = 'cnn'; model.name is 'mlp': "
                         "set model.patch_size=0"),
    (["model.patch_size=0"], "model.patch_grad = 3 needs model.patch_size (the patches' side)"),
    (["data.digit_scale=5"], "data.digit_scale = 5 makes 40-pixel digits, larger than data.canvas_size = 32; lower "
                             "the scale or raise the canvas"),
])
def test_bad_patch_settings_name_what_to_change(sets, message):
    with pytest.raises(PlaitError) as e:
        check_job(_job(*sets))
    assert str(e.value) == message
