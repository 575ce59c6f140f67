"""optim.lr_scaling and the LAMB / LARS optimizers, against their formulas on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch
from ft_helpers import assert_same, gpt, run_trajectory

from plait.config import load_config
from plait.train.job import check_job
from plait.train.optim import Lamb, Lars, lr_at, peak_lr


def test_lr_scaling_linear_and_sqrt_with_warmup():
    cfg = load_config(None, ["optim.lr=0.1", "optim.base_batch_size=32", "optim.warmup_steps=4", "optim.schedule='constant'"])
    assert peak_lr(cfg.optim, 256) == 0.1
    cfg.optim.lr_scaling = "linear"
    assert peak_lr(cfg.optim, 256) == pytest.approx(0.8)  # Goyal et al.: k times the batch, k times the rate
    assert [lr_at(s, cfg.optim, 100, 256) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8])
    cfg.optim.lr_scaling = "sqrt"
    assert peak_lr(cfg.optim, 256) == pytest.approx(0.1 * math.sqrt(8))  # Krizhevsky 2014
    assert peak_lr(cfg.optim, 8) == pytest.approx(0.05)


def _lamb_reference(w, grads, lr, b1, b2, eps, wd):
    """LAMB written out step by step in float64 (You et al. 2020, Algorithm 2, one layer)."""
    w, m, v = w.double().clone(), torch.zeros_like(w, dtype=torch.float64), torch.zeros_like(w, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        r = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
        u = r + wd * w
        wn, un = float(w.norm()), float(u.norm())
        ratio = wn / un if wn > 0 and un > 0 else 1.0
        w = w - lr * ratio * u
    return w


def _lars_reference(w, grads, lr, momentum, wd, eta):
    w, buf = w.double().clone(), torch.zeros_like(w, dtype=torch.float64)
    for g in grads:
        g = g.double()
        wn, gn = float(w.norm()), float(g.norm())
        local = eta * wn / (gn + wd * wn) if wn > 0 and gn > 0 else 1.0
        buf = momentum * buf + lr * local * (g + wd * w)
        w = w - buf
    return w


@pytest.mark.parametrize("start", ["random", "zero"])
def test_lamb_and_lars_follow_their_update_formulas(start):
    torch.manual_seed(0)
    w0 = torch.randn(3, 4) if start == "random" else torch.zeros(3, 4)  # zero: the trust ratio falls back to 1
    grads = [torch.randn(3, 4) for _ in range(3)]
    for opt_cls, kw, ref in ((Lamb, dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1),
                              lambda: _lamb_reference(w0, grads, 0.05, 0.9, 0.99, 1e-6, 0.1)),
                             (Lars, dict(lr=0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02),
                              lambda: _lars_reference(w0, grads, 0.5, 0.9, 0.01, 0.02))):
        p = torch.nn.Parameter(w0.clone())
        opt = opt_cls([p], **kw)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        torch.testing.assert_close(p.detach().double(), ref(), rtol=1e-5, atol=1e-6)
        assert not torch.equal(p.detach(), w0)


@pytest.mark.parametrize("zero", [0, 1])
def test_lamb_trains_the_same_at_dp2_and_zero1_and_zero2_3_accept_layerwise_optimizers(pool2, tiny_text, tmp_path, zero):
    """ZeRO-1 gives each rank whole tensors (plait.parallel.zero), so a trust ratio's norms are whole there too; ZeRO-2/3
    shard each tensor, and DTensor reduces a shard's norm across the ranks (tests/parallel/test_zero_lamb.py runs
    them)."""
    lamb = ["optim.name='lamb'", "optim.lr=0.02", "optim.weight_decay=0.01", "optim.eps=1e-6"]
    ref = run_trajectory(load_config(None, gpt(tiny_text, "parallel.dp=1", *lamb)), tmp_path / "one")
    assert ref[0][-1] < ref[0][0]
    got = pool2.run(run_trajectory, load_config(None, gpt(tiny_text, "parallel.dp=2", f"parallel.zero={zero}", *lamb)),
                    tmp_path / "two")[0]
    assert_same(ref, got, tol=1e-5)
    for stage in (2, 3):
        layout = check_job(load_config(None, gpt(tiny_text, "parallel.dp=2", f"parallel.zero={stage}", "optim.name='lars'")))
        assert layout.zero == stage
