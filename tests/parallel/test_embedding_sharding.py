"""DeepFM on the synthetic click log: sharded embedding tables (table-wise, row-wise) against the unsharded model."""

import json

import pytest
import torch

from helpers import max_diff, params_after, rank0_params
from plait.config import load_config
from plait.errors import ConfigError
from plait.train.job import load_job

DEEPFM = ["model.name='deepfm'", "data.name='clicks'", "model.width=32", "model.embedding_dim=4",
          "data.synthetic_samples=2000", "data.clicks_cardinalities=[3, 17, 50, 400]", "train.global_batch_size=32",
          "train.micro_batch_size=8", "train.eval_samples=200", "train.eval_batch_size=50", "optim.lr=0.01",
          "log.progress=false", "log.report=false", "checkpoint.every=0", "optim.eps=1e-6"]


def cfg(*more):
    return load_config(None, DEEPFM + list(more))


def held(run_dir, mode):
    """Pool task: the bytes of embedding parameters this rank holds after a short run."""
    from plait.train.trainer import train

    r = train(cfg("parallel.dp=2", f"parallel.embedding_sharding='{mode}'", "train.steps=1"), run_dir)
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in r.module.embed.parameters())


@pytest.mark.parametrize("mode", ["table", "row"])
def test_each_rank_holds_a_share_of_the_tables(pool2, mode):
    rows = [3, 17, 50, 400]
    total = sum(rows) * (4 + 1)
    per_rank = pool2.run(held, None, mode)
    assert sum(per_rank) == total
    if mode == "row":  # ceil(rows / 2) on rank 0, the rest on rank 1
        assert per_rank[0] == sum(-(-r // 2) for r in rows) * 5
    else:  # the largest table alone on one rank, the others on the other
        assert sorted(per_rank) == [(3 + 17 + 50) * 5, 400 * 5]


def test_sharded_run_resumes_unsharded(pool2, tmp_path):
    straight = params_after(cfg("parallel.dp=1", "train.steps=8"), None)
    pool2.run(rank0_params, cfg("parallel.dp=2", "parallel.embedding_sharding='row'", "train.steps=8",
                                "train.stop_after=4", "checkpoint.every=4"), tmp_path)
    got = params_after(cfg("parallel.dp=1", "train.steps=8"), tmp_path, resume=True)
    assert max_diff(straight, got) <= 1e-4


def test_deepfm_learns_the_click_model(tmp_path):
    from plait.train.trainer import train

    c = cfg("parallel.dp=1", "train.steps=150", "data.synthetic_samples=8000", "train.eval_samples=1600",
            "train.global_batch_size=128", "train.micro_batch_size=128")
    s = train(c, tmp_path).summary
    # from chance (ln 2) most of the way down to the generating model's own loss
    assert s["initial_loss"] == pytest.approx(0.69, abs=0.03)
    assert s["val_loss"] < s["ground_truth_val_loss"] + 0.4 * (0.69 - s["ground_truth_val_loss"])
    assert json.loads((tmp_path / "summary.json").read_text())["val_accuracy"] > 0.6


def test_clicks_fields_have_very_different_cardinalities():
    from plait.data import build_data

    c = load_config(None, ["model.name='deepfm'", "data.name='clicks'"])
    b = build_data(c.data, c.model)
    ids = torch.cat([b.train.x, b.val.x])[:, :5].long()
    assert b.spec.cardinalities == [8, 64, 512, 4096, 32768]
    for f, card in enumerate(b.spec.cardinalities):
        counts = torch.bincount(ids[:, f], minlength=card)
        assert ids[:, f].max() < card and counts[0] == counts.max()  # Zipf: id 0 is the most frequent


@pytest.mark.parametrize("overrides, message", [
    (["parallel.embedding_sharding='row'"], "shards deepfm's embedding tables; model.name is 'gpt'"),
    (DEEPFM + ["parallel.dp=1", "parallel.embedding_sharding='table'"], "needs parallel.dp >= 2"),
    (["model.name='deepfm'"], "model.name = 'deepfm' cannot train on data.name = 'stdlib-text'"),
])
def test_bad_sharding_configs(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_job(None, overrides)
