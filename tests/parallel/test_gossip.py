"""Gossip (decentralized SGD): the mixing of each graph, convergence on digits, the consensus distance shrinking."""

import json

import pytest

from plait.parallel.gossip import neighbour_offsets


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


@pytest.mark.slow
def test_gossip_converges_on_digits_and_its_consensus_distance_shrinks(pool2, tmp_path):
    summary, rows, average = pool2.run(train_digits, tmp_path / "g", "parallel.gossip_every=4")[0]
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

    assert max_diff(load_file(str(export(tmp_path / "g"))), average) == 0.0
