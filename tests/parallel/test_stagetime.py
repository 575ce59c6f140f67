"""parallel.pp_split = "auto": stages balanced by block times measured on each pipeline rank (plait.parallel.stagetime)."""

from __future__ import annotations

import json

import pytest

from helpers import TINY_GPT, max_diff, params_after
from plait.config import load_config
from plait.errors import ConfigError
from plait.parallel.stagetime import heterogeneous_bounds

SGD = ("optim.name='sgd'", "optim.lr=0.3", "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0",
       "optim.schedule='constant'", "optim.warmup_steps=0", "log.every=1", "train.steps=3", "checkpoint.every=0",
       "model.vocab_size=160", "model.layers=4", "train.global_batch_size=8", "train.micro_batch_size=2")


def test_the_split_minimises_the_slowest_stage_with_each_ranks_own_times():
    assert heterogeneous_bounds([[1, 1, 1, 1], [1, 1, 1, 1]], 2) == [(0, 2), (2, 4)]
    assert heterogeneous_bounds([[1, 1, 1, 1], [3, 3, 3, 3]], 2) == [(0, 3), (3, 4)]  # 3 vs 3, not 2 vs 6
    assert heterogeneous_bounds([[3, 3, 3, 3], [1, 1, 1, 1]], 2) == [(0, 1), (1, 4)]
    # the first block also carries the embeddings
    assert heterogeneous_bounds([[5, 1, 1, 1], [5, 1, 1, 1]], 2) == [(0, 1), (1, 4)]
    assert heterogeneous_bounds([[1, 1, 1, 1, 1, 1]] * 3, 3) == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(ConfigError, match="cannot cut 2 blocks into 3 pipeline stages"):
        heterogeneous_bounds([[1, 1]] * 3, 3)


def slow_rank_one(cfg, run_dir):
    """Pool task: rank 1 is an 8x slower device (its forward/backward sleeps 7x its compute); train.

    Any ratio above 1.5 between the ranks' measured block times gives rank 1 one block of four; 8x leaves room for
    load from other processes, which slowed rank 0's millisecond-long blocks to twice rank 1's compute in one CI run
    (a 3x fault then measured 1.4x and the split stayed [0, 2), [2, 4))."""
    import os

    import torch.distributed as dist

    os.environ["PLAIT_FAULTS"] = "slow:rank=1:factor=8"
    try:
        params = params_after(cfg, run_dir)
    finally:
        del os.environ["PLAIT_FAULTS"]
    return params if dist.get_rank() == 0 else None


def test_a_slower_pipeline_rank_gets_fewer_blocks_on_the_same_trajectory(pool2, tiny_text, tmp_path):
    base = [*TINY_GPT, *SGD, "data.name='text'", f"data.path='{tiny_text}'"]
    ref = params_after(load_config(None, [*base, "parallel.dp=1"]), tmp_path / "one")
    run = tmp_path / "auto"
    cfg = load_config(None, [*base, "parallel.dp=1", "parallel.pp=2", "parallel.pp_split='auto'"])
    got = pool2.run(slow_rank_one, cfg, run)[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["pipeline"]["stage_blocks"] == [[0, 3], [3, 4]]  # parameters alone would cut [0, 2), [2, 4)
    assert max_diff(ref, got) <= 1e-5


@pytest.mark.parametrize(("sets", "message"), [
    (["parallel.pp_split='fast'"], "parallel.pp_split = 'fast': give block indices (e.g. [2]), [] (balanced by "
                                   "parameters) or 'auto' (balanced by measured block times)"),
    (["parallel.pp_split='auto'", "parallel.pp_schedule='interleaved-1f1b'", "parallel.virtual_stages=2"],
     "parallel.pp_split = 'auto' places one stage per pipeline rank; with parallel.virtual_stages = 2 give the cut "
     "points"),
])
def test_bad_splits_are_refused(sets, message):
    from plait.train.job import check_job

    cfg = load_config(None, ["parallel.dp=1", "parallel.pp=2", *sets], validate=False)
    with pytest.raises(ConfigError) as e:
        check_job(cfg)
    assert str(e.value) == message
