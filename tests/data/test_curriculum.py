"""data.curriculum: the pacing function, batches from the easiest pool, scores by file, length and a run's loss, and
a dp=2 run on the one-process trajectory."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import params_after, rank0_params, step_losses
from plait.config import load_config
from plait.data.curriculum import CurriculumSampler, length_scores, pool_fraction
from plait.errors import ConfigError, DataError
from plait.train.job import check_job


def test_the_pool_grows_by_its_pacing_function_and_batches_come_from_it():
    assert pool_fraction(0, 100, 0.2, 0.5, "linear") == 0.2
    assert pool_fraction(25, 100, 0.2, 0.5, "linear") == pytest.approx(0.6)
    assert pool_fraction(25, 100, 0.2, 0.5, "root") == pytest.approx(0.2 + 0.8 * math.sqrt(0.5))
    assert pool_fraction(50, 100, 0.2, 0.5, "root") == pool_fraction(99, 100, 0.2, 0.5, "linear") == 1.0
    scores = torch.randperm(1000, generator=torch.Generator().manual_seed(0)).double()
    s = CurriculumSampler(scores, 32, seed=5, steps=100, start=0.1, full_at=0.5, pacing="linear")
    assert [s.pool(k) for k in (0, 10, 25, 50, 90)] == [100, 280, 550, 1000, 1000]
    for step in (0, 10, 25):
        batch = s.global_batch(step)
        assert len(set(batch.tolist())) == 32  # without replacement
        assert scores[batch].max() < s.pool(step)  # scores are 0..999: the pool is the easiest pool(step)
    again = CurriculumSampler(scores, 32, seed=5, steps=100, start=0.1, full_at=0.5, pacing="linear")
    assert torch.equal(s.global_batch(17), again.global_batch(17))  # a function of (seed, step)
    assert not torch.equal(s.global_batch(17), s.global_batch(18))


def test_length_scores_count_trained_tokens_and_refuse_labels():
    from plait.data.datasets import Tensors

    rows = Tensors(torch.zeros(2, 6), torch.tensor([[-100, -100, 3, 4, 5, 6], [-100] * 5 + [1]]))
    assert length_scores(rows).tolist() == [4.0, 1.0]
    with pytest.raises(DataError, match="needs token samples"):
        length_scores(Tensors(torch.zeros(3, 2), torch.tensor([2, 0, 1])))


def _digits(*sets):
    return load_config(None, ["model.name=mlp", "data.name=digits", "model.width=16", "model.depth=1",
                              "train.global_batch_size=16", "train.micro_batch_size=8", "train.steps=8",
                              "train.eval_every=0", "train.eval_samples=64", "checkpoint.every=0", "log.every=1",
                              "log.progress=false", "log.report=false", "optim.name=sgd", "optim.momentum=0",
                              "optim.weight_decay=0", "optim.grad_clip=0", "optim.warmup_steps=0", "optim.lr=0.5",
                              "optim.schedule=constant", *sets])



def test_a_loss_curriculum_at_dp2_is_the_one_process_run(pool2, tmp_path):
    ref = tmp_path / "ref"
    params_after(_digits("parallel.dp=1"), ref)  # the scorer: a run of the same model
    cur = (f"data.curriculum={{score='loss', model='{ref}', pacing='root', start=0.1, full_at=0.5}}",)
    one = params_after(_digits("parallel.dp=1", *cur), tmp_path / "one")
    two = pool2.run(rank0_params, _digits("parallel.dp=2", *cur), tmp_path / "two")[0]
    a, b = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert len(a) == len(b) == 8
    for (l1, g1), (l2, g2) in zip(a, b):
        assert l2 == pytest.approx(l1, rel=1e-5) and g2 == pytest.approx(g1, rel=1e-5)
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5
    # step 1 drew its batch from the easiest 10 %: each of its samples' losses under the scorer is that small
    from plait.data import build_data
    from plait.train.build import loss_scores
    from plait.train.loss import loss_for

    cfg = _digits("parallel.dp=1", *cur)
    bundle = build_data(cfg.data, cfg.model)
    scores = loss_scores(str(ref), bundle.train, loss_for(bundle.spec))
    s = CurriculumSampler(scores, 16, cfg.train.seed, 8, start=0.1, full_at=0.5, pacing="root")
    cutoff = scores.sort().values[s.pool(0) - 1]
    assert (scores[s.global_batch(0)] <= cutoff).all() and s.pool(0) == math.ceil(0.1 * len(scores))


@pytest.mark.parametrize("sets, message", [
    (["data.curriculum={pacing='linear'}"], "data.curriculum.score is missing: 'length', 'loss' or a JSON file"),
    (["data.curriculum={score='length', pace='root'}"], "data.curriculum has unknown keys ['pace']"),
    (["data.curriculum={score='length', pacing='cubic'}"], "data.curriculum.pacing = 'cubic': choose linear or root"),
    (["data.curriculum={score='length', start=0}"], "data.curriculum.start = 0 must be a number in (0, 1], e.g. 0.2"),
    (["data.curriculum={score='loss'}"], "data.curriculum.score = 'loss' scores samples by a trained model's loss"),
    (["data.curriculum={score='length'}", "data.sampler='balanced'"], "data.curriculum orders the samples itself"),
])
def test_bad_curricula_are_named(sets, message):
    with pytest.raises(ConfigError) as e:
        check_job(_digits("parallel.dp=1", *sets))
    assert str(e.value).startswith(message)


def test_a_scores_file_must_have_one_number_per_sample(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps([1.0, 2.0]))
    with pytest.raises(DataError) as e:
        params_after(_digits("parallel.dp=1", f"data.curriculum={{score='{tmp_path / 's.json'}'}}"), tmp_path / "r")
    assert "has 2 scores; the training split has" in str(e.value)
