"""parallel.hetero: data-parallel ranks of unequal speed get unequal slices of the global batch, and the run stays
on the homogeneous trajectory (plain SGD: per-step loss and gradient norm, final weights, against one process)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from helpers import params_after
from plait.config import load_config
from plait.data.loader import StepLoader
from plait.data.sampler import GlobalBatchSampler
from plait.errors import ConfigError
from plait.parallel import check_config
from plait.parallel.hetero import HeteroShares, split_counts

STEPS = 12
MLP = ["model.name='mlp'", "data.name='digits'", "model.width=32", "train.global_batch_size=32",
       "train.micro_batch_size=8", "train.eval_samples=64", "train.eval_batch_size=32", "log.progress=false",
       "log.report=false", "log.every=1", f"train.steps={STEPS}", "checkpoint.every=0", "optim.name='sgd'",
       "optim.lr=0.3", "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0", "optim.schedule='constant'",
       "optim.warmup_steps=0", "data.prefetch=1"]


def test_split_counts_follow_the_speeds_and_sum_to_the_batch():
    assert split_counts(32, [1, 3]) == [9, 23]
    assert split_counts(32, [1, 1]) == [16, 16]
    assert split_counts(10, [1, 1, 1]) == [4, 3, 3]
    assert split_counts(5, [100, 1]) == [4, 1]  # every rank keeps a sample
    with pytest.raises(ConfigError, match="a global batch of 1 cannot give each of 2 data-parallel ranks a sample"):
        split_counts(1, [1, 1])


@pytest.mark.parametrize("sets, message", [
    (["parallel.hetero=auto", "parallel.zero=3"], "it needs parallel.dp >= 2 with tp = pp = ep = cp = 1, zero = 0"),
    (["parallel.hetero='1,2,3'"], "give 2 positive relative speeds (one per data-parallel rank, parallel.dp = 2)"),
    (["parallel.hetero=auto", "parallel.hetero_every=2"], "parallel.hetero_every = 2 must be >= data.prefetch + 2"),
])
def test_bad_hetero_settings_are_refused(sets, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(load_config(None, sets))


class _Indices:
    def fetch(self, idx):
        return idx, idx


def test_the_ranks_slices_are_the_global_batch_in_order():
    sampler = GlobalBatchSampler(100, 10, seed=1)
    shares = HeteroShares([1.0, 4.0], dp=2, global_batch=10, every=5)
    assert shares.counts(0) == [3, 7]
    per_rank = [list(StepLoader(_Indices(), sampler, 0, 3, r, 2, 4, prefetch=0, slices=shares.offsets))
                for r in range(2)]
    assert [len(x) for x, _ in per_rank[0][0]] == [3] and [len(x) for x, _ in per_rank[1][0]] == [4, 3]
    for step in range(3):
        got = torch.cat([x for r in range(2) for x, _ in per_rank[r][step]])
        assert torch.equal(got, sampler.global_batch(step))


def _run(cfg, run_dir, faults: str = ""):
    """Pool task: train with PLAIT_FAULTS set on this rank; rank 0's weights and its run's metrics."""
    os.environ["PLAIT_FAULTS"] = faults
    try:
        import torch.distributed as dist

        params = params_after(cfg, run_dir)
        return params if dist.get_rank() == 0 else None
    finally:
        os.environ.pop("PLAIT_FAULTS", None)


def _trajectory(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    return [r["loss"] for r in steps], [r["grad_norm"] for r in steps], rows


# auto measures wall-clock compute: at width 32 a rank computes a step in ~2 ms, so one 10 ms preemption of the fast
# rank (a loaded machine) reads as the slower device; at width 1024 (~40 ms a step) the factor of 3 stands out.
WIDE = ["model.width=1024", "model.depth=3"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The one-process reference run for each model the cases train (computed on first use)."""
    runs = {}

    def get(*sets: str):
        if sets not in runs:
            run = tmp_path_factory.mktemp("single")
            runs[sets] = params_after(load_config(None, [*MLP, *sets, "parallel.dp=1"]), run), run
        return runs[sets]

    return get


@pytest.mark.parametrize("hetero, faults, sets", [("'1,3'", "", ()), ("'auto'", "slow:rank=1:factor=3", tuple(WIDE))])
def test_unequal_shares_keep_the_single_process_trajectory(pool2, single, tmp_path, hetero, faults, sets):
    ref_params, ref_run = single(*sets)
    cfg = load_config(None, [*MLP, *sets, "parallel.dp=2", f"parallel.hetero={hetero}", "parallel.hetero_every=4"])
    params = pool2.run(_run, cfg, tmp_path, faults)[0]
    loss, gnorm, rows = _trajectory(tmp_path)
    ref_loss, ref_gnorm, _ = _trajectory(ref_run)
    assert loss == pytest.approx(ref_loss, rel=1e-5) and gnorm == pytest.approx(ref_gnorm, rel=1e-5)
    assert max(float((params[k] - ref_params[k]).abs().max()) for k in ref_params) <= 1e-5
    shares = [r["batch_shares"] for r in rows if "batch_shares" in r]
    if hetero == "'1,3'":
        assert all(s == [9, 23] for s in shares)
    else:  # rank 1 is 3x slower: after the first measurement it gets the smaller share
        assert shares[0] == [16, 16] and shares[-1][0] >= 2 * shares[-1][1], shares
        assert any(r.get("event") == "hetero_resplit" for r in rows)
