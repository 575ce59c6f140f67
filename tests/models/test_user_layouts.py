"""A user's own model on every layout: an nn.Sequential cut into pipeline stages, a transformer block split by
megatron_plan for tensor parallel, each trained against one process; models that cannot take a layout are
refused before launch (tests/user_models.py holds the models)."""

import json

import pytest
import torch.nn as nn

from helpers import max_diff, params_after, rank0_params
from plait.config import load_config
from plait.errors import ConfigError
from plait.models.protocols import megatron_plan, pipeline_blocks
from plait.train.job import load_job

SGD = ["data.name=digits", "optim.name=sgd", "optim.momentum=0", "optim.weight_decay=0", "optim.lr=0.2",
       "optim.warmup_steps=0", "optim.schedule='constant'", "optim.grad_clip=0", "train.steps=4",
       "train.global_batch_size=16", "train.micro_batch_size=8", "train.eval_samples=16", "train.eval_batch_size=8",
       "log.progress=false", "log.report=false", "log.every=1", "checkpoint.every=0"]


def losses(run_dir):
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.parametrize("factory, layout", [
    ("user_models:sequential", ["parallel.pp=2", "parallel.pp_schedule='gpipe'"]),
    ("user_models:transformer", ["parallel.tp=2"]),
])
def test_a_users_model_trains_as_on_one_process(pool2, tmp_path, factory, layout):
    base = [*SGD, f"model.factory='{factory}'"]
    one = params_after(load_config(None, [*base, "parallel.dp=1"]), tmp_path / "one")
    two = pool2.run(rank0_params, load_config(None, [*base, "parallel.dp=1", *layout]), tmp_path / "two")[0]
    assert max_diff(one, two) <= 1e-5
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), abs=1e-5)
    assert len(losses(tmp_path / "one")) == 4


def test_megatron_plan_finds_attention_and_linear_pairs():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from user_models import transformer

    plan = megatron_plan(transformer())
    assert {k: type(v) for k, v in plan.items()} == {
        "2.q": ColwiseParallel, "2.k": ColwiseParallel, "2.v": ColwiseParallel, "2.out": RowwiseParallel,
        "2.mlp.0": ColwiseParallel, "2.mlp.2": RowwiseParallel}
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    assert {k: type(v) for k, v in megatron_plan(seq).items()} == {"0": ColwiseParallel, "3": RowwiseParallel}
    assert list(pipeline_blocks(seq)) == ["0", "1", "2", "3", "4", "5"]


@pytest.mark.parametrize("overrides, message", [
    (["model.factory='user_models:sequential'", "parallel.pp=8", "train.global_batch_size=64"],
     "parallel.pp (8) * parallel.virtual_stages (1) = 8 stages but user_models:sequential has 6 block(s) to cut "
     "between: every stage needs one; set parallel.pp=6 or lower"),
    (["model.factory='user_models:flat'", "parallel.pp=2"],
     "parallel.pp = 2 cuts the model into stages, but user_models:flat (Linear) is no nn.Sequential and has no "
     "`pipeline_parts()` naming its blocks (docs/models.md); set parallel.pp=1"),
    (["model.factory='user_models:transformer'", "model.options={width = 30, head_dim = 5}", "parallel.tp=4",
      "train.global_batch_size=16"],
     "parallel.tp = 4 splits 2.q (out_features = 30), which is not divisible by 4; make it a multiple of 4 or set "
     "parallel.tp=1"),
])
def test_a_model_that_cannot_take_the_layout_is_refused_before_launch(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_job(None, ["data.name=digits", "parallel.dp=1", *overrides])
    assert str(e.value) == message


def test_plait_train_exits_2_with_one_line(tmp_path, capsys):
    from plait.cli import main

    code = main(["train", "--set", "data.name=digits", "--set", "model.factory=user_models:flat", "--set",
                 "parallel.pp=2", "--set", "parallel.dp=1", "--out", str(tmp_path / "run")])
    assert code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
