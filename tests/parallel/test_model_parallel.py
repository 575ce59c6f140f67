"""Pipeline and tensor parallel: resuming across layouts and the configuration errors.

That every layout follows the single-process trajectory is tests/parallel/test_equivalence.py's, with plain SGD;
the pipeline bubble against theory is tests/parallel/test_bubble.py's.
"""

import pytest

from helpers import max_diff, params_after, rank0_params, tiny_gpt_config
from plait.errors import ConfigError
from plait.train.job import load_job

# The tiny corpus has 159 characters; tensor parallel splits the vocabulary, so round it up.
BASE = ("model.vocab_size=160", "model.layers=4", "train.global_batch_size=8", "train.micro_batch_size=2")


def cfg(corpus, *more):
    return tiny_gpt_config(corpus, *BASE, *more)


@pytest.fixture(scope="module")
def straight(tiny_text):
    """The 10 steps in one process, uninterrupted: its final weights (computed once for both resumes below)."""
    return params_after(cfg(tiny_text, "parallel.dp=1", "train.steps=10"), None)


@pytest.mark.parametrize("first, then", [
    (("parallel.dp=1", "parallel.pp=2"), "dp2"),
    (("parallel.dp=1", "parallel.tp=2"), "dp1"),
])
def test_resume_across_layouts(pool2, tiny_text, tmp_path, straight, first, then):
    pool2.run(rank0_params, cfg(tiny_text, "train.steps=10", "train.stop_after=5", *first), tmp_path)
    if then == "dp2":
        got = pool2.run(rank0_params, cfg(tiny_text, "parallel.dp=2", "train.steps=10"), tmp_path, True)[0]
    else:
        got = params_after(cfg(tiny_text, "parallel.dp=1", "train.steps=10"), tmp_path, resume=True)
    assert max_diff(straight, got) <= 1e-4


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

    with pytest.raises(DistributedError, match=r"the vocabulary \(159 rows\) is not divisible by parallel.tp = 2; pad "
                                               r"it with model.vocab_multiple = 2 \(or 64: every tp degree dividing it\)"
                                               r", or set model.vocab_size to a multiple of 2"):
        pool2.run(rank0_params, tiny_gpt_config(tiny_text, "parallel.dp=1", "parallel.tp=2", "train.steps=1"), None)
    with pytest.raises(DistributedError, match=r"model.heads \(3\) is not divisible by parallel.tp = 2"):
        pool2.run(rank0_params, cfg(tiny_text, "parallel.dp=1", "parallel.tp=2", "model.heads=3", "model.width=48",
                                    "train.steps=1"), None)
