"""Deep ensembles (model.ensemble; plait.models.ensemble): at dp 2 and at ZeRO-3 each member follows its own
one-process run (train.init_seed = seed + k) under plain SGD, the ensemble's loss is the members' mean and its
gradient norm theirs together; an export rebuilds the ensemble, which predicts the members' mean probability, and
serving adds their spread; what an ensemble cannot be is named."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import params_after, rank0_params, step_losses
from plait.config import load_config
from plait.data.spec import DataSpec
from plait.errors import ConfigError
from plait.models import build_model
from plait.train.job import check_job

SEED = 1234


def _job(*sets):
    return load_config(None, ["model.name=mlp", "data.name=digits", "model.width=16", "model.depth=1",
                              "train.global_batch_size=16", "train.micro_batch_size=8", "train.steps=6",
                              "train.eval_every=0", "train.eval_samples=64", "checkpoint.every=0", "log.every=1",
                              "log.progress=false", "log.report=false", "optim.name=sgd", "optim.momentum=0",
                              "optim.weight_decay=0", "optim.grad_clip=0", "optim.warmup_steps=0", "optim.lr=0.5",
                              "optim.schedule=constant", f"train.seed={SEED}", *sets])


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    """Each member's own one-process run: (weights, per-step losses and norms, run dir)."""
    d = tmp_path_factory.mktemp("members")
    out = []
    for k in range(2):
        run = d / f"m{k}"
        weights = params_after(_job("parallel.dp=1", f"train.init_seed={SEED + k}"), run)
        out.append((weights, step_losses(run), run))
    return out


def spread_run(cfg, run_dir):
    """Pool task: rank 0's full parameters and val loss, and the member parameters every rank holds itself."""
    import torch.distributed as dist

    from plait.train.trainer import train

    r = train(cfg, run_dir)
    full = r.strategy.full_model_state_dict()
    held = sorted({n.split(".")[1] for n, _ in r.strategy.module.named_parameters()})
    return (full, r.summary["val_loss"], held) if dist.get_rank() == 0 else held


@pytest.fixture(scope="module")
def replicated_val_loss(tmp_path_factory):
    """The ensemble's validation loss when one process runs both members."""
    from plait.train.trainer import train

    return train(_job("parallel.dp=1", "model.ensemble=2"), tmp_path_factory.mktemp("one")).summary["val_loss"]


# dp2: one rank per member (spread); dp4: two ranks per member, each pair averaging its own member's gradients
# (spread); zero3: both members on both ranks, sharded (ZeRO does not spread them)
@pytest.mark.parametrize("layout", [["parallel.dp=2"], ["parallel.dp=4"], ["parallel.dp=2", "parallel.zero=3"]],
                         ids=["dp2", "dp4", "zero3"])
def test_each_member_follows_its_own_run(pool2, pool4, tmp_path, members, replicated_val_loss, layout):
    pool = pool4 if "parallel.dp=4" in layout else pool2
    (got, val_loss, held0), *held = pool.run(spread_run, _job(*layout, "model.ensemble=2", "train.micro_batch_size=4"),
                                             tmp_path / "ens")
    if "parallel.zero=3" in layout:
        assert [held0, *held] == [["0", "1"]] * 2
    else:  # consecutive groups of dp / 2 ranks, one member each
        half = (len(held) + 1) // 2
        assert [held0, *held] == [["0"]] * half + [["1"]] * half
    assert val_loss == pytest.approx(replicated_val_loss, rel=1e-5)  # the members' mean probability, gathered
    for k, (weights, _, _) in enumerate(members):
        assert set(weights) == {n.removeprefix(f"members.{k}.") for n in got if n.startswith(f"members.{k}.")}
        assert max((got[f"members.{k}.{n}"] - w).abs().max().item() for n, w in weights.items()) < 1e-5
    ens, one, two = step_losses(tmp_path / "ens"), members[0][1], members[1][1]
    assert len(ens) == 6
    for (loss, norm), (l1, g1), (l2, g2) in zip(ens, one, two):
        assert loss == pytest.approx((l1 + l2) / 2, rel=1e-5)  # the members' mean loss
        assert norm == pytest.approx(math.hypot(g1, g2), rel=1e-5)  # each member's own gradient, together


def test_an_exported_ensemble_predicts_the_members_mean_probability_and_serves_their_spread(tmp_path, members):
    from plait.api import export
    from plait.export import load_exported
    from plait.serve.executor.runner import Runner
    from plait.serve.model.load import ModelRef, load_model

    params_after(_job("parallel.dp=1", "model.ensemble=2"), tmp_path / "ens")
    ens, _ = load_exported(export(tmp_path / "ens", tmp_path / "ens.safetensors"))
    singles = [load_exported(export(run, tmp_path / f"{run.name}.safetensors"))[0] for _, _, run in members]
    ens.eval()
    x = torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        probs = torch.stack([torch.softmax(m.eval()(x), -1) for m in singles])
        assert torch.allclose(ens(x), probs.mean(0).log(), atol=1e-5)
    served = load_model(ModelRef(str(tmp_path / "ens.safetensors")))
    assert [t.name for t in served.outputs] == ["logits", "label", "spread"]
    out = Runner(served).infer(x.numpy())
    label = probs.mean(0).argmax(-1)
    assert np.array_equal(out["label"], label.numpy())
    chosen = probs.gather(-1, label.expand(2, 5)[..., None]).squeeze(-1)  # (members, rows)
    assert np.allclose(out["spread"], chosen.std(0, unbiased=False).numpy(), atol=1e-6)


@pytest.mark.parametrize("sets, message", [
    (["parallel.tp=2", "model.name=gpt", "model.ensemble=2"],
     "model.ensemble = 2 with parallel.tp = 2: an ensemble trains with dp and ZeRO (every rank runs every member on "
     "its share of the batch); set them to 1"),
    (["model.ensemble=2", "train.objective=contrastive"],
     "model.ensemble = 2 with train.objective = 'contrastive': ensembles are supervised; set model.ensemble=1"),
])
def test_what_an_ensemble_cannot_be_is_named(sets, message):
    with pytest.raises(ConfigError) as e:
        check_job(_job("parallel.dp=2", "train.micro_batch_size=8", *sets))
    assert str(e.value) == message


def test_an_ensemble_of_a_regression_is_refused():
    cfg = _job("model.ensemble=3")
    with pytest.raises(ConfigError) as e:
        build_model(cfg.model, DataSpec(name="table", task="regression", input_shape=[4], num_classes=1))
    assert str(e.value) == ("model.ensemble = 3 averages the members' class probabilities; this data's task is "
                            "'regression': set model.ensemble=1")


def test_a_spread_checkpoint_resumes_with_both_members_on_one_process(pool2, tmp_path, members):
    """Each member's rank saves its own member; one process resumes them both and ends on their own runs' weights."""
    pool2.run(rank0_params, _job("parallel.dp=2", "model.ensemble=2", "train.micro_batch_size=4",
                                 "train.stop_after=3", "checkpoint.every=3"), tmp_path)
    got = params_after(_job("parallel.dp=1", "model.ensemble=2"), tmp_path, resume=True)
    for k, (weights, _, _) in enumerate(members):
        assert max((got[f"members.{k}.{n}"] - w).abs().max().item() for n, w in weights.items()) < 1e-5
