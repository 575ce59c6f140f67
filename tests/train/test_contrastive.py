"""Contrastive training: NT-Xent against the whole global batch, layout-independent views, a linear probe."""

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from helpers import params_after
from plait.config import load_config
from plait.data import build_data
from plait.data.augment import TwoViews
from plait.errors import ConfigError
from plait.train.job import load_job
from plait.train.loss import nt_xent

BASE = ["model.name=mlp", "data.name=digits", "train.objective=contrastive", "log.progress=false", "log.report=false",
        "checkpoint.every=0", "train.eval_samples=64", "train.eval_batch_size=32", "log.every=1"]
SGD = ["optim.name=sgd", "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0", "optim.schedule=constant",
       "optim.warmup_steps=0", "optim.lr=0.5"]


def test_nt_xent_is_the_formula():
    torch.manual_seed(0)
    z = torch.randn(3, 2, 4)
    t = 0.5
    u = F.normalize(z.reshape(6, 4), dim=1)
    total = 0.0
    for i in range(6):
        pos = i ^ 1
        num = math.exp(float(u[i] @ u[pos]) / t)
        den = sum(math.exp(float(u[i] @ u[k]) / t) for k in range(6) if k != i)
        total += -math.log(num / den)
    assert float(nt_xent(z, t)) == pytest.approx(total / 6, rel=1e-6)


def test_views_depend_on_the_sample_and_step_only():
    bundle = build_data(load_config(None, BASE).data, load_config(None, BASE).model)
    views = TwoViews(bundle.train, seed=7, shift=1, noise=0.1)
    idx = torch.tensor([5, 9, 11, 40])
    whole, y = views.fetch_at(idx, 3)
    assert whole.shape == (4, 2, 1, 8, 8) and torch.equal(y, bundle.train.fetch(idx)[1])
    # a rank or micro-batch that takes a part of the batch sees the same views of its samples
    assert torch.equal(views.fetch_at(idx[2:], 3)[0], whole[2:])
    assert not torch.equal(whole[:, 0], whole[:, 1])  # two different views
    assert not torch.equal(views.fetch_at(idx, 4)[0], whole)  # new views at another step


def trajectory(cfg, run_dir):
    """Train (in this process, or as a pool task); rank 0 returns (per-step loss, grad norm, final weights)."""
    import torch.distributed as dist

    params = params_after(cfg, run_dir)
    if dist.is_initialized() and dist.get_rank():
        return None
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows], params


def test_dp2_gathers_negatives_from_both_ranks_and_matches_one_process(pool2, tmp_path):
    cfg = lambda dp: load_config(None, [*BASE, *SGD, f"parallel.dp={dp}", "train.global_batch_size=32",  # noqa: E731
                                        f"train.micro_batch_size={32 // dp}", "train.steps=4"])
    losses, norms, weights = trajectory(cfg(1), tmp_path / "one")
    got_losses, got_norms, got_weights = pool2.run(trajectory, cfg(2), tmp_path / "two")[0]
    assert got_losses == pytest.approx(losses, rel=1e-5) and got_norms == pytest.approx(norms, rel=1e-5)
    assert max(float((weights[k] - got_weights[k]).abs().max()) for k in weights) <= 1e-5
    assert losses[-1] < losses[0]


def test_the_linear_probe_beats_the_untrained_encoder(tmp_path):
    from plait.train.trainer import train

    def probe(steps, lr):
        cfg = load_config(None, [*BASE, "parallel.dp=1", "train.global_batch_size=128", "train.micro_batch_size=128",
                                 f"train.steps={steps}", f"optim.lr={lr}", "log.every=50"])
        summary = train(cfg, tmp_path / f"run{steps}").summary
        return summary["contrastive"]

    trained, untrained = probe(200, 3e-3), probe(1, 1e-9)
    # chance is 0.1; the untrained encoder's features already separate digits (0.85 here), training adds to that
    assert trained["linear_probe_accuracy"] >= 0.87
    assert trained["linear_probe_accuracy"] >= untrained["linear_probe_accuracy"] + 0.02
    assert trained["similarity_bytes_per_rank"] == (2 * 128) * (2 * 128) * 4


@pytest.mark.parametrize("overrides, message", [
    (["model.name=gpt", "data.name=stdlib-text"], "data.name = 'stdlib-text' has none"),
    (["parallel.sync=gossip"], "gathers every rank's embeddings over the dp axis"),
    (["train.global_batch_size=32", "train.micro_batch_size=8"],
     "must equal train.global_batch_size (32); set train.micro_batch_size=16"),
    (["model.factory=torch.nn:Identity"], "needs a model that outputs one embedding per sample (batch, features), but "
                                          "torch.nn:Identity outputs shape (1, 1, 8, 8)"),
])
def test_bad_contrastive_configs(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_job(None, [*BASE, *overrides])
