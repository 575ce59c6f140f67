"""Bad input for parallel.sync and parallel.compression: rejected at config time with the rule and the fix, verbatim.

The parameter server's own rules (servers and workers, the process count) are in test_ps.py."""

import pytest

from plait.errors import ConfigError
from plait.train.job import load_job

DIGITS = ["model.name='mlp'", "data.name='digits'"]


def message(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_job(None, [*DIGITS, *overrides])
    return str(e.value)


def test_negative_staleness():
    assert message("parallel.ps_mode='ssp'", "parallel.staleness=-1") == (
        "parallel.staleness = -1 must be >= 0 (how many steps a worker may run ahead of the slowest one; 0 = lockstep); "
        "set --set parallel.staleness=2")


def test_compression_on_a_sync_without_all_reduce():
    for sync in ("ps", "gossip"):
        assert message(f"parallel.sync='{sync}'", "parallel.compression='powersgd'") == (
            f"parallel.compression = 'powersgd' compresses the data-parallel all-reduce, but parallel.sync = '{sync}' has "
            "none; set parallel.compression='none' or parallel.sync='allreduce'")


def test_compression_needs_ddp():
    with pytest.raises(ConfigError) as e:  # the default GPT: tensor parallel under ZeRO-3
        load_job(None, ["parallel.compression='int8'", "parallel.dp=2", "parallel.tp=2", "parallel.zero=3"])
    assert str(e.value) == (
        "parallel.compression = 'int8' runs on DDP's buckets, ZeRO's reduce-scatter or tensor-parallel shards averaged "
        "over dp: it needs parallel.dp >= 2 and plain DDP, ZeRO-1, tp x dp with zero = 0, or zero = 2 or 3 with "
        "tp = ep = 1 (pp, cp too) and no embedding_sharding (here dp = 2, tp = 2, pp = 1, ep = 1, zero = 3, sync = "
        "'allreduce'); set parallel.compression='none' or change the layout")
    assert message("parallel.compression='topk'", "parallel.topk_ratio=0.0") == (
        "parallel.topk_ratio = 0.0 must be in (0, 1] (the share of gradient entries sent, e.g. 0.01); "
        "set --set parallel.topk_ratio=0.01")
    assert message("parallel.compression='powersgd'", "parallel.powersgd_rank=0") == (
        "parallel.powersgd_rank = 0 must be >= 1 (the rank of PowerSGD's approximation, e.g. 2); "
        "set --set parallel.powersgd_rank=2")


@pytest.mark.parametrize("key, value, choices", [
    ("sync", "'allgather'", "allreduce, ps, gossip"),
    ("compression", "'qsgd'", "none, fp16, bf16, powersgd, topk, int8"),
    ("ps_mode", "'hogwild'", "sync, async, ssp"),
    ("gossip_topology", "'torus'", "ring, exponential"),
])
def test_unknown_algorithm_names(key, value, choices):
    assert message(f"parallel.{key}={value}") == (
        f"parallel.{key} = {value} is not one of: {choices}; set one of those")


def test_sync_schemes_need_plain_data_parallelism():
    assert message("parallel.sync='gossip'", "parallel.dp=1", "train.micro_batch_size=32") == (
        "parallel.sync = 'gossip' needs neighbours to average with: parallel.dp = 1; set parallel.dp >= 2")
    assert message("parallel.sync='gossip'", "parallel.gossip_every=0") == (
        "parallel.gossip_every = 0 must be >= 1 (steps between neighbour averages); set --set parallel.gossip_every=1")
    assert message("parallel.sync='ps'", "parallel.zero=2") == (
        "parallel.sync = 'ps' replaces DDP's all-reduce and works on plain data parallelism: it needs tp = pp = ep = cp = 1, "
        "zero = 0 and no embedding_sharding (here dp = 2, tp = 1, pp = 1, ep = 1, cp = 1, zero = 2); set "
        "parallel.sync='allreduce' or change the layout")
    assert message("parallel.sync='ps'", "precision.dtype='fp16'") == (
        "parallel.sync = 'ps' does not take fp16 loss scaling; set precision.dtype='bf16' or 'fp32'")
