"""Gossip (decentralized SGD): the mixing of each graph, convergence on digits, the consensus distance shrinking;
asynchronous gossip (AD-PSGD): its bipartite graph, the exactness of one pairwise average, convergence against
synchronous gossip, the config error."""

import json

import pytest

from plait.errors import ConfigError
from plait.parallel.gossip import neighbour_offsets
from plait.parallel.gossip_async import async_offsets
from plait.train.job import load_job


def test_neighbour_offsets_of_ring_and_exponential_graphs():
    assert neighbour_offsets(2, "ring") == [1]
    assert neighbour_offsets(4, "ring") == [1, 3]
    assert neighbour_offsets(4, "exponential") == [1, 2, 3]
    assert neighbour_offsets(8, "exponential") == [1, 2, 4, 6, 7]
    assert neighbour_offsets(5, "ring") == [1, 4]


# The mixing of each graph on 2, 3 and 4 ranks is tested in test_comm_algorithms.py, on its pools of ranks.


def train_digits(run_dir, *more):
    """Pool task: MLP on digits with gossip; (summary, metrics rows) on rank 0."""
    import torch.distributed as dist

    from plait.config import load_config
    from plait.train.trainer import train

    cfg = load_config(None, ["model.name='mlp'", "data.name='digits'", "parallel.dp=2", "train.steps=150",
                             "train.micro_batch_size=16", "optim.warmup_steps=5", "log.progress=false",
                             "log.report=false", "log.every=10", "checkpoint.every=0", "train.eval_samples=512",
                             "parallel.sync='gossip'", *more])
    result = train(cfg, run_dir)
    average = result.strategy.full_model_state_dict()  # a collective
    if dist.get_rank():
        return None
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return result.summary, rows, average


@pytest.fixture(scope="module")
def sync_gossip(pool2, tmp_path_factory):
    """Synchronous gossip every 4 steps, 150 steps: (run dir, summary, metrics rows, average model)."""
    run_dir = tmp_path_factory.mktemp("gossip") / "g"
    return (run_dir, *pool2.run(train_digits, run_dir, "parallel.gossip_every=4")[0])


@pytest.mark.slow
def test_gossip_converges_on_digits_and_its_consensus_distance_shrinks(sync_gossip):
    run_dir, summary, rows, average = sync_gossip
    assert summary["parallel"]["strategy"] == "gossip"
    assert summary["val_accuracy"] >= 0.9
    dist = {r["step"]: r["consensus_distance"] for r in rows if "consensus_distance" in r}
    assert len(dist) >= 10
    apart = [d for step, d in sorted(dist.items()) if step % 4]  # local steps since the last round pull ranks apart
    assert all(d > 0 for d in apart) and all(d < 1e-6 for step, d in dist.items() if step % 4 == 0)
    assert max(apart[-3:]) < max(apart[:3]) / 2  # with the decaying learning rate they agree more and more
    # The checkpoint (and so the export) holds the ranks' average model, the one evaluated.
    from safetensors.torch import load_file

    from helpers import max_diff
    from plait.export import export

    assert max_diff(load_file(str(export(run_dir))), average) == 0.0


def test_adpsgd_graph_joins_active_even_ranks_to_passive_odd_ones():
    assert async_offsets(2, "ring") == [1]
    assert async_offsets(4, "ring") == [1, 3]
    assert async_offsets(8, "ring") == [1, 7]
    assert async_offsets(8, "exponential") == [1, 3, 5, 7]
    assert async_offsets(16, "exponential") == [1, 3, 5, 7, 9, 11, 13, 15]
    assert all(d % 2 for n in (2, 4, 6, 10) for d in async_offsets(n, "exponential"))


def test_adpsgd_needs_synchronous_gossip_and_an_even_dp():
    def message(*overrides):
        with pytest.raises(ConfigError) as e:
            load_job(None, ["model.name='mlp'", "data.name='digits'", *overrides])
        return str(e.value)

    assert message("parallel.gossip_async=true") == (
        "parallel.gossip_async = true is asynchronous gossip and needs parallel.sync = 'gossip' (here 'allreduce'); "
        "set parallel.sync='gossip' or parallel.gossip_async=false")
    assert message("parallel.gossip_async=true", "parallel.sync='gossip'", "parallel.dp=3",
                   "train.global_batch_size=48") == (
        "parallel.gossip_async pairs each active (even) rank with passive (odd) ones and needs an even parallel.dp: "
        "dp = 3; set parallel.dp=4")


def pair_average(seed):
    """Pool task: rank 0 (active) averages once with rank 1 (passive, whose server thread answers); rank 1 then
    changes its own parameters by -0.5 as its step would, after the average was decided and before it applied it.
    Returns (before, after, staleness or the decided average, exchanges made, exchanges served) on every rank."""
    import time

    import torch
    import torch.distributed as dist

    from plait.parallel.gossip_async import PairAverager

    torch.manual_seed(seed + dist.get_rank())
    tensors = [torch.randn(5, 3), torch.randn(7)]
    before = [t.clone() for t in tensors]
    link = dist.new_group([0, 1], backend="gloo")
    a = PairAverager(tensors, link, "ring", seed)
    a.steps = 4 if a.active else 1  # before the server thread starts: it may answer at once, reading its rank's steps
    a.start()
    if a.active:
        stale = a.exchange(4)
    else:
        while a.served == 0:  # the average is decided and pending; this rank's own step comes after it
            time.sleep(0.001)
        with a.lock:
            decided = a.pending[0].clone()
            for t in tensors:
                t.sub_(0.5)
            a.apply_pending()
        stale = list(torch._utils._unflatten_dense_tensors(decided, tensors))
    a.close()
    dist.destroy_process_group(link)
    return before, [t.clone() for t in tensors], stale, a.exchanges, a.served


def test_adpsgd_pairwise_average_is_exact(pool2):
    (b0, a0, stale, made, _), (b1, a1, decided, _, served) = pool2.run(pair_average, 7)
    for x0, x1, y0, d1, y1 in zip(b0, b1, a0, decided, a1):
        mean = (x0 + x1) / 2
        assert (y0 - mean).abs().max() <= 1e-7  # the active rank holds the mean of before
        assert (d1 - mean).abs().max() <= 1e-7  # so does the passive one, as decided
        assert (y1 - (mean - 0.5)).abs().max() <= 1e-6  # and it applies it under its own step: the mean - 0.5
    assert (stale, made, served) == (3, 1, 1)  # 4 steps against 1


@pytest.mark.slow
def test_adpsgd_converges_within_2_points_of_synchronous_gossip(pool2, tmp_path, sync_gossip):
    summary, rows, _ = pool2.run(train_digits, tmp_path / "a", "parallel.gossip_async=true")[0]
    assert summary["parallel"]["strategy"] == "gossip_async"
    assert abs(summary["val_accuracy"] - sync_gossip[1]["val_accuracy"]) <= 0.02  # the same 150 steps
    g = summary["gossip"]
    # Rank 0 is active and averaged after each of its 150 steps; rank 1 is passive and answered each.
    assert (g["roles"], g["exchanges_per_rank"], g["served_per_rank"]) == (["active", "passive"], [150, 0], [0, 150])
    assert g["local_steps_per_rank"] == [150, 150] and sum(g["staleness_hist"].values()) == 150
    # Each logging window (log.every = 10) counts its exchanges; a logging step's all-gather lines the ranks up,
    # so two ranks are never more than log.every steps apart.
    windows = [r for r in rows if "exchanges" in r]
    assert [r["step"] for r in windows] == [1, *range(10, 151, 10)]
    assert sum(r["exchanges"] for r in windows) == 150
    assert all(0 <= r["staleness_max"] <= 10 and r["consensus_distance"] >= 0 for r in windows)


def train_then_resume(run_dir):
    """Pool task: 10 AD-PSGD steps with a checkpoint at the end, then a resume that takes no step; each rank's
    (parameters, Adam moments) flat, at the end of the first session and as the resume loaded them."""
    import torch

    from plait.config import load_config
    from plait.train.trainer import train

    def flat(result):
        s = result.strategy
        params = list(s.module.parameters())
        moments = [s.optimizer.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
        return torch.cat([p.detach().flatten() for p in params]), torch.cat([m.flatten() for m in moments])

    cfg = load_config(None, ["model.name='mlp'", "data.name='digits'", "parallel.dp=2", "train.steps=20",
                             "train.stop_after=10", "checkpoint.every=10", "train.eval_every=0", "train.eval_samples=64",
                             "log.progress=false", "log.report=false", "parallel.sync='gossip'", "parallel.gossip_async=true"])
    first = flat(train(cfg, run_dir))
    return first, flat(train(cfg, run_dir, resume=True))


def test_adpsgd_checkpoint_resumes_every_rank_from_the_average_model_and_optimizer_state(pool2, tmp_path):
    ((params0, moments0), loaded0), ((params1, moments1), loaded1) = pool2.run(train_then_resume, tmp_path / "r")
    assert (moments0 - moments1).abs().max() > 1e-4  # each rank's Adam saw its own gradients
    for loaded in (loaded0, loaded1):  # Adam's moments averaged as a pair, not one from each rank
        assert (loaded[0] - (params0 + params1) / 2).abs().max() <= 1e-6
        assert (loaded[1] - (moments0 + moments1) / 2).abs().max() <= 1e-7
