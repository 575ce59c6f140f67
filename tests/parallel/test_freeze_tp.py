"""A fixed finetune.freeze under tensor parallel: the frozen DTensor parameters get no gradient and no optimizer state,
and tp2, dp2 x tp2 and pp2 x tp2 equal one process under plain SGD (per-step loss and grad norm, weights: 1e-4)."""

from __future__ import annotations

import pytest

from helpers import params_after, rank0_params, step_losses, tiny_gpt_config

SGD = ["train.steps=4", "checkpoint.every=0", "optim.name=sgd", "optim.momentum=0", "optim.weight_decay=0",
       "optim.grad_clip=0", "optim.warmup_steps=0", "optim.lr=0.5", "optim.schedule=constant",
       "finetune.freeze=['blocks.0.*', 'tok_emb*']", "model.vocab_multiple=64"]
LAYOUTS = {
    "tp2": (2, ("parallel.dp=1", "parallel.tp=2")),
    "dp2xtp2": (4, ("parallel.dp=2", "parallel.tp=2", "train.micro_batch_size=2")),
    "pp2xtp2": (4, ("parallel.dp=1", "parallel.pp=2", "parallel.tp=2")),
}


@pytest.fixture(scope="module")
def one(tiny_text, tmp_path_factory):
    cache: dict = {}

    def get(*more: str):
        if more not in cache:
            run = tmp_path_factory.mktemp("one") / "run"
            cache[more] = params_after(tiny_gpt_config(tiny_text, "parallel.dp=1", *SGD, *more), run), step_losses(run)
        return cache[more]

    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_freezing_under_tp_follows_one_process(request, tiny_text, tmp_path, one, name):
    world, layout = LAYOUTS[name]
    pool = request.getfixturevalue(f"pool{world}")
    model = tuple(s for s in layout if s.startswith("model."))
    weights, losses = one(*model)
    got = pool.run(rank0_params, tiny_gpt_config(tiny_text, *SGD, *layout), tmp_path / "run")[0]
    mine = step_losses(tmp_path / "run")
    assert len(mine) == len(losses) == 4
    for (l1, g1), (l2, g2) in zip(losses, mine):
        assert l2 == pytest.approx(l1, rel=1e-4) and g2 == pytest.approx(g1, rel=1e-4)
    assert got.keys() == weights.keys()
    assert max((weights[k] - got[k]).abs().max().item() for k in weights) < 1e-4
