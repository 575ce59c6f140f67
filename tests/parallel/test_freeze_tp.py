"""A fixed finetune.freeze under tensor parallel: the frozen DTensor parameters get no gradient and no optimizer state,
and tp2, dp2 x tp2 and pp2 x tp2 equal one process under plain SGD (per-step loss and grad norm, weights: 1e-4)."""

from __future__ import annotations

import pytest

from helpers import PLAIN_SGD, TP_LAYOUTS, assert_follows, one_process_runs, rank0_params, tiny_gpt_config

SGD = ["train.steps=4", *PLAIN_SGD, "finetune.freeze=['blocks.0.*', 'tok_emb*']", "model.vocab_multiple=64"]
LAYOUTS = TP_LAYOUTS


@pytest.fixture(scope="module")
def one(tiny_text, tmp_path_factory):
    return one_process_runs(tiny_text, tmp_path_factory.mktemp("one"), *SGD)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_freezing_under_tp_follows_one_process(request, tiny_text, tmp_path, one, name):
    world, layout = LAYOUTS[name]
    pool = request.getfixturevalue(f"pool{world}")
    got = pool.run(rank0_params, tiny_gpt_config(tiny_text, *SGD, *layout), tmp_path / "run")[0]
    assert_follows(one(), got, tmp_path / "run", steps=4, rel=1e-4, atol=1e-4)
