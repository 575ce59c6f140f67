"""Cutting a model into pipeline stages: balance, user cut points, plain names, exact composition."""

import pytest
import torch

from plait.errors import ConfigError
from plait.models.gpt import GPT
from plait.parallel.split import balanced_bounds, bounds_from_split, pipeline_stage, stage_bounds


@pytest.mark.parametrize("sizes, stages, expected", [
    ([1, 1, 1, 1], 2, [(0, 2), (2, 4)]),
    ([5, 1, 1, 1, 1, 1], 2, [(0, 1), (1, 6)]),
    ([1] * 8, 3, [(0, 2), (2, 5), (5, 8)]),
    ([3, 1, 1, 1, 3], 3, [(0, 1), (1, 4), (4, 5)]),
    ([2, 2], 1, [(0, 2)]),
])
def test_balanced_bounds_minimise_the_largest_stage(sizes, stages, expected):
    got = balanced_bounds(sizes, stages)
    assert got == expected
    assert [a for a, _ in got][0] == 0 and got[-1][1] == len(sizes)


def test_bad_stage_counts_and_cut_points():
    with pytest.raises(ConfigError, match="cannot cut 2 blocks into 3 pipeline stages"):
        balanced_bounds([1, 1], 3)
    with pytest.raises(ConfigError, match=r"parallel.pp_split = \[3, 2\] must be increasing"):
        bounds_from_split([3, 2], 4)
    assert bounds_from_split([3, 6], 8) == [(0, 3), (3, 6), (6, 8)]
    with pytest.raises(ConfigError, match=r"gives 3 stages but parallel.pp = 2"):
        stage_bounds(GPT(10, 4, 8, 2, 4), 2, [1, 2])


def test_embeddings_and_head_count_towards_the_end_stages():
    model = GPT(vocab_size=1000, context=8, width=16, heads=2, layers=4, tie_embeddings=False)
    # each block has 12*16^2 + 13*16 = 3280 parameters; tok_emb + pos_emb = 16128 and the head 16032
    assert stage_bounds(model, 3) == [(0, 1), (1, 3), (3, 4)]


@pytest.mark.parametrize("tied", [True, False])
def test_stages_compose_to_the_whole_model_and_keep_plain_names(tied):
    torch.manual_seed(0)
    model = GPT(vocab_size=30, context=16, width=32, heads=4, layers=5, tie_embeddings=tied)
    bounds = stage_bounds(model, 3)
    stages = [pipeline_stage(model, bounds, s) for s in range(3)]
    x = torch.randint(0, 30, (2, 16))
    h = x
    for st in stages:
        h = st(h)
    assert torch.equal(h, model(x))
    names = [set(st.state_dict()) for st in stages]
    assert set().union(*names) == set(model.state_dict())
    assert "tok_emb.weight" in names[0] and "head.weight" in names[-1]
    assert not any(n.startswith("blocks.0.") for n in names[-1])
