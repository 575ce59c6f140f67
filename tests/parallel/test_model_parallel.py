"""Pipeline and tensor parallel (and their mixes with dp) against the single-process reference."""

import json

import pytest

from helpers import max_diff, params_after, rank0_params, tiny_gpt_config
from plait.errors import ConfigError
from plait.testing import RankPool
from plait.train.job import load_job

# The tiny corpus has 159 characters; tensor parallel splits the vocabulary, so round it up.
BASE = ("model.vocab_size=160", "model.layers=4", "train.global_batch_size=8", "train.micro_batch_size=2")


def cfg(corpus, *more):
    return tiny_gpt_config(corpus, *BASE, *more)


@pytest.fixture(scope="module")
def pool4():
    with RankPool(4, timeout_s=120) as pool:
        yield pool


@pytest.fixture(scope="module")
def reference(tiny_text):
    return params_after(cfg(tiny_text, "parallel.dp=1", "train.steps=5"), None)


@pytest.mark.parametrize("layout", [
    ("parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule='gpipe'"),
    ("parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule='1f1b'"),
    ("parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule='interleaved-1f1b'", "parallel.virtual_stages=2"),
    ("parallel.dp=1", "parallel.tp=2"),
    ("parallel.dp=1", "parallel.tp=2", "parallel.sequence_parallel=true"),
], ids=["pp2-gpipe", "pp2-1f1b", "pp2-interleaved", "tp2", "tp2-sp"])
def test_two_rank_layouts_match_one_process(pool2, tiny_text, reference, layout):
    got = pool2.run(rank0_params, cfg(tiny_text, "train.steps=5", *layout), None)[0]
    assert max_diff(reference, got) <= 1e-4


@pytest.mark.parametrize("layout", [
    ("parallel.dp=2", "parallel.pp=2"),
    ("parallel.dp=2", "parallel.tp=2"),
    ("parallel.dp=1", "parallel.pp=2", "parallel.tp=2"),
    ("parallel.dp=1", "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"),
    ("parallel.dp=2", "parallel.tp=2", "parallel.zero=3"),
], ids=["dp2xpp2", "dp2xtp2", "pp2xtp2", "pp2xtp2-sp", "dp2xtp2-zero3"])
def test_four_rank_hybrids_match_one_process(pool4, tiny_text, reference, layout):
    got = pool4.run(rank0_params, cfg(tiny_text, "train.steps=5", *layout), None)[0]
    assert max_diff(reference, got) <= 1e-4


def test_untied_embeddings_under_pipeline_and_tensor_parallel(pool4, tiny_text):
    ref = params_after(cfg(tiny_text, "parallel.dp=1", "train.steps=4", "model.tie_embeddings=false"), None)
    got = pool4.run(rank0_params, cfg(tiny_text, "parallel.dp=1", "parallel.pp=2", "parallel.tp=2", "train.steps=4",
                                      "model.tie_embeddings=false"), None)[0]
    assert max_diff(ref, got) <= 1e-4


@pytest.mark.parametrize("first, then", [
    (("parallel.dp=1", "parallel.pp=2"), "dp2"),
    (("parallel.dp=1", "parallel.tp=2"), "dp1"),
])
def test_resume_across_layouts(pool2, tiny_text, tmp_path, first, then):
    straight = params_after(cfg(tiny_text, "parallel.dp=1", "train.steps=10"), None)
    pool2.run(rank0_params, cfg(tiny_text, "train.steps=10", "train.stop_after=5", *first), tmp_path)
    if then == "dp2":
        got = pool2.run(rank0_params, cfg(tiny_text, "parallel.dp=2", "train.steps=10"), tmp_path, True)[0]
    else:
        got = params_after(cfg(tiny_text, "parallel.dp=1", "train.steps=10"), tmp_path, resume=True)
    assert max_diff(straight, got) <= 1e-4


def test_pipeline_reports_its_bubble_and_draws_the_timeline(pool2, tiny_text, tmp_path):
    for schedule, m in (("gpipe", 4), ("1f1b", 4)):
        run = tmp_path / schedule
        pool2.run(rank0_params, cfg(tiny_text, "parallel.dp=1", "parallel.pp=2", f"parallel.pp_schedule='{schedule}'",
                                    "train.steps=4", f"parallel.microbatches={m}", "train.global_batch_size=8"), run)
        p = json.loads((run / "summary.json").read_text())["pipeline"]
        assert p["bubble_fraction_theory"] == pytest.approx((2 - 1) / (m + 2 - 1))
        assert 0.0 < p["bubble_fraction"] < 1.0
        # GPipe holds every micro-batch's activations on the first stage; 1F1B at most p
        expected_first = m if schedule == "gpipe" else 2
        assert p["peak_inflight_per_rank"][0] == expected_first
        assert (run / "pipeline.png").stat().st_size > 10_000


@pytest.mark.parametrize("overrides, message", [
    (["parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule='interleaved-1f1b'"],
     "needs parallel.virtual_stages >= 2"),
    (["parallel.dp=1", "parallel.pp=2", "parallel.virtual_stages=2"], "needs parallel.pp_schedule = 'interleaved-1f1b'"),
    (["parallel.dp=1", "parallel.pp=8", "model.layers=4", "train.global_batch_size=16"],
     r"parallel.pp \(8\) \* parallel.virtual_stages \(1\) = 8 stages but model.layers = 4"),
    (["parallel.dp=1", "parallel.pp=2", "parallel.pp_split=[1, 2]"], r"gives 3 stages but the layout has 2"),
    (["parallel.sequence_parallel=true"], "needs parallel.tp > 1"),
    (["parallel.zero=1", "parallel.tp=2", "train.global_batch_size=32"], "parallel.zero = 1 does not combine"),
    (["parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule='interleaved-1f1b'", "parallel.virtual_stages=2",
      "parallel.microbatches=3", "train.global_batch_size=48"], r"multiple of parallel.pp \(2\)"),
])
def test_bad_model_parallel_configs(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_job(None, overrides)


def test_indivisible_heads_or_vocabulary_is_a_clear_error(pool2, tiny_text):
    from plait.testing import DistributedError

    with pytest.raises(DistributedError, match=r"the vocabulary \(159\) is not divisible by parallel.tp = 2; "
                                               r"set model.vocab_size to a multiple of 2, e.g. model.vocab_size=160"):
        pool2.run(rank0_params, tiny_gpt_config(tiny_text, "parallel.dp=1", "parallel.tp=2", "train.steps=1"), None)
    with pytest.raises(DistributedError, match=r"model.heads \(3\) is not divisible by parallel.tp = 2"):
        pool2.run(rank0_params, cfg(tiny_text, "parallel.dp=1", "parallel.tp=2", "model.heads=3", "model.width=48",
                                    "train.steps=1"), None)
