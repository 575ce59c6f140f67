"""parallel.allreduce: DDP's gradient all-reduce through plait's own algorithms follows native's trajectory.

Plain SGD on an MLP on digits at dp = 2 (the layout tests' setting, tests/parallel/test_equivalence.py): on two
ranks every algorithm adds the same two numbers per entry, so loss, gradient norm and weights equal native's to
float rounding, and each sends what gloo's ring is counted as sending. The hook's average and its bytes on 2, 3
and 4 ranks, per algorithm, are in test_comm_algorithms.py.
"""

import json

import pytest

from plait.errors import ConfigError
from plait.train.job import load_job

STEPS = 4
JOB = ["model.name='mlp'", "data.name='digits'", "model.width=64", "train.global_batch_size=64",
       "train.micro_batch_size=32", "parallel.dp=2", "optim.name='sgd'", "optim.lr=0.3", "optim.momentum=0",
       "optim.weight_decay=0", "optim.grad_clip=0", "optim.schedule='constant'", "optim.warmup_steps=0",
       f"train.steps={STEPS}", "log.every=1", "log.progress=false", "log.report=false", "checkpoint.every=0",
       "train.eval_samples=64", "train.eval_batch_size=64"]


def train_with(algo, run_dir):
    """Pool task: the job with parallel.allreduce = algo; rank 0's (losses, grad norms, comm bytes, final weights)."""
    import torch.distributed as dist

    from plait.config import load_config
    from plait.train.trainer import train

    result = train(load_config(None, [*JOB, f"parallel.allreduce='{algo}'"]), run_dir)
    params = result.strategy.full_model_state_dict()
    hooked = result.strategy.model._get_ddp_logging_data().get("comm_hook")
    if dist.get_rank():
        return None
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows], [r["comm_bytes"] for r in rows], params, hooked


@pytest.fixture(scope="module")
def runs(pool2, tmp_path_factory):
    return {algo: pool2.run(train_with, algo, tmp_path_factory.mktemp(algo))[0]
            for algo in ("native", "ring", "tree", "hierarchical")}


@pytest.mark.parametrize("algo", ["ring", "tree", "hierarchical"])
def test_training_through_plaits_all_reduce_follows_native(runs, algo):
    loss, norm, sent, params, hook = runs[algo]
    loss0, norm0, sent0, params0, hook0 = runs["native"]
    assert (hook0, hook) == ("ddp_allreduce_hook", "algorithm_hook")
    assert len(loss) == STEPS and loss[-1] < loss[0]
    assert max(abs(a - b) for a, b in zip(loss, loss0)) <= 1e-6
    assert max(abs(a - b) for a, b in zip(norm, norm0)) <= 1e-6
    assert max(float((params[k] - params0[k]).abs().max()) for k in params0) <= 1e-6
    # Two ranks: each sends the whole gradient once (half in the reduce-scatter, half in the all-gather; the
    # hierarchical member hands it all in and the leader hands the sum back), what all_reduce is counted as.
    weights = sum(t.numel() for t in params0.values()) * 4
    assert sent == sent0 and all(s >= weights for s in sent)


def many_buckets(algo):
    """Pool task: a 3-layer MLP in tiny DDP buckets (their all-reduces overlap backward on the hook's thread),
    3 steps of SGD; the weights."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from plait.comm.accounting import AlgorithmHookState, algorithm_hook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=0.02)
    if algo != "native":
        ddp.register_comm_hook(AlgorithmHookState(None, algo, 1), algorithm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(16, 64, generator=g)).pow(2).sum().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_several_buckets_in_flight_keep_the_ranks_in_step(pool2):
    native = pool2.run(many_buckets, "native")[0]
    for algo in ("ring", "tree"):
        a, b = pool2.run(many_buckets, algo)
        assert a.equal(b) and float((a - native).abs().max()) <= 1e-6, algo


def message(*overrides):
    with pytest.raises(ConfigError) as e:
        load_job(None, ["model.name='mlp'", "data.name='digits'", *overrides])
    return str(e.value)


def test_allreduce_needs_plain_ddp_and_no_compression():
    assert message("parallel.allreduce='ring'", "parallel.zero=2") == (
        "parallel.allreduce = 'ring' runs DDP's gradient all-reduce as a comm hook: it needs parallel.sync = 'allreduce' "
        "and dp >= 2 with tp = pp = ep = 1, zero = 0 and no embedding_sharding (here dp = 2, tp = 1, pp = 1, ep = 1, "
        "zero = 2, sync = 'allreduce'); set parallel.allreduce='native' or change the layout")
    assert message("parallel.allreduce='tree'", "parallel.compression='fp16'") == (
        "parallel.allreduce = 'tree' and parallel.compression = 'fp16' are both DDP comm hooks and a model takes one; "
        "set parallel.allreduce='native' (compression makes its own collectives) or parallel.compression='none'")
    assert message("parallel.allreduce='butterfly'") == (
        "parallel.allreduce = 'butterfly' is not one of: native, ring, tree, hierarchical; set one of those")
    assert message("parallel.allreduce='hierarchical'", "parallel.allreduce_local_size=-1") == (
        "parallel.allreduce_local_size = -1 must be >= 0 (ranks per node for allreduce = 'hierarchical'; 0: "
        "LOCAL_WORLD_SIZE); set --set parallel.allreduce_local_size=0")
