"""Meta-learning (train.objective = "meta"): episodes, the two outer gradients against a hand-written reference, and
dp / ZeRO-3 on the one-process trajectory."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import PLAIN_SGD, assert_follows, params_after, rank0_params, step_losses
from plait.config import load_config
from plait.data.episodes import episodic
from plait.data.sources import build_data
from plait.errors import ConfigError
from plait.models.fewshot import MetaLearner
from plait.train.job import check_job

META = ["data.name=digits", "model.name=mlp", "model.width=32", "model.depth=2", "train.objective=meta",
        "train.global_batch_size=8", "train.eval_samples=16", "train.eval_batch_size=4", "log.progress=false",
        "log.report=false", "log.every=1", "train.steps=4", "train.eval_every=0", "data.ways=3", "data.shots=2",
        "data.queries=3", "train.inner_steps=2", "train.inner_lr=0.3", *PLAIN_SGD]


def meta_config(*more: str):
    return load_config(None, [*META, *more])


def adapted_by_hand(base: nn.Module, support: torch.Tensor, labels: torch.Tensor, steps: int, lr: float) -> nn.Module:
    """The inner loop written as ordinary training of a copy: `steps` of SGD at `lr` on the support cross-entropy."""
    fast = copy.deepcopy(base)
    opt = torch.optim.SGD(fast.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(fast(support), labels).backward()
        opt.step()
    return fast


@pytest.mark.parametrize("algorithm", ["reptile", "fomaml"])
def test_outer_gradient_and_loss_are_the_algorithms(algorithm):
    torch.manual_seed(0)
    ways, shots, queries = 3, 2, 4
    base = nn.Sequential(nn.Flatten(), nn.Linear(12, 7), nn.Tanh(), nn.Linear(7, ways))
    learner = MetaLearner(copy.deepcopy(base), ways, shots, queries, algorithm, inner_steps=3, inner_lr=0.4)
    episodes = torch.randn(2, ways * (shots + queries), 3, 4)
    y = torch.randint(0, ways, (2, ways * queries))
    out = learner(episodes)
    loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
    extra = learner.extra_loss()
    total = loss if extra is None else loss + extra
    total.backward()
    assert learner.extra_loss() is None  # taken once
    labels = torch.arange(ways).repeat_interleave(shots)
    want = {n: torch.zeros_like(p) for n, p in base.named_parameters()}
    losses = []
    for e in range(2):
        fast = adapted_by_hand(base, episodes[e, :ways * shots], labels, 3, 0.4)
        q = F.cross_entropy(fast(episodes[e, ways * shots:]), y[e])
        losses.append(float(q))
        if algorithm == "reptile":
            for (n, p), (_, f) in zip(base.named_parameters(), fast.named_parameters()):
                want[n] += (p - f).detach() / 2
        else:
            for (n, _), g in zip(fast.named_parameters(), torch.autograd.grad(q, list(fast.parameters()))):
                want[n] += g / 2
    assert float(total.detach()) == pytest.approx(float(sum(losses) / 2), rel=1e-5)  # the logged loss: the query loss at phi
    for n, p in learner.base.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6)


def test_episodes_are_seeded_and_keep_held_out_classes_apart():
    cfg = meta_config("data.episodes=50")
    bundle = episodic(build_data(cfg.data, cfg.model), cfg.data, 7, {"algorithm": "reptile", "inner_steps": 1,
                                                                      "inner_lr": 0.1})
    again = episodic(build_data(cfg.data, cfg.model), cfg.data, 7, {"algorithm": "reptile", "inner_steps": 1,
                                                                     "inner_lr": 0.1})
    x, y = bundle.train.fetch(torch.tensor([3, 41]))
    assert x.shape == (2, 3 * (2 + 3), 1, 8, 8) and y.tolist() == [[0, 0, 0, 1, 1, 1, 2, 2, 2]] * 2
    assert torch.equal(x, again.train.fetch(torch.tensor([3, 41]))[0])  # episode i is (seed, i)'s, whoever asks
    assert not torch.equal(x[0], x[1])
    assert bundle.spec.task == "fewshot" and bundle.spec.num_classes == 3 and len(bundle.train) == 50
    trained = {c for i in range(50) for p in bundle.train.draw(i) for c in {bundle.train.sources[0][1][k] for _, k in p}}
    held = {int(bundle.val.sources[s][1][k]) for i in range(20) for p in bundle.val.draw(i) for s, k in p}
    assert {int(c) for c in trained} == set(range(7)) and held == {7, 8, 9}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    root = tmp_path_factory.mktemp("meta-one")
    return {a: (params_after(meta_config(f"train.meta_algorithm={a}", "parallel.dp=1", "train.micro_batch_size=2"),
                             root / a),
                step_losses(root / a)) for a in ("reptile", "fomaml")}


@pytest.mark.parametrize("algorithm", ["reptile", "fomaml"])
@pytest.mark.parametrize("zero", [0, 3], ids=["ddp", "zero3"])
def test_data_parallel_meta_learning_follows_one_process(pool2, tmp_path, one_process, algorithm, zero):
    run = tmp_path / "dp2"
    got = pool2.run(rank0_params, meta_config(f"train.meta_algorithm={algorithm}", "parallel.dp=2",
                                              f"parallel.zero={zero}", "train.micro_batch_size=2"), run)[0]
    assert_follows(one_process[algorithm], got, run, steps=4, rel=1e-5, atol=1e-6)


@pytest.mark.parametrize("more, message", [
    (["parallel.dp=1", "parallel.tp=2", "model.name=gpt", "data.name=stdlib-text"],
     "train.objective = 'meta' adapts a whole copy of the model to each episode on its rank: it needs tp = pp = ep = 1 "
     "and sync = 'allreduce' (here tp = 2, pp = 1, ep = 1, sync = 'allreduce'); use data parallel or ZeRO"),
    (["data.mix=mixup"], "train.objective = 'meta' trains on episodes it draws itself; data.mix cannot apply to them: "
                         "turn it off or use train.objective='supervised'"),
    (["data.ways=4"], "data.ways = 4 classes per episode, but validation episodes draw from data.holdout_classes = 3: "
                      "hold out at least data.ways classes"),
])
def test_meta_learning_refuses_what_it_cannot_do(more, message):
    with pytest.raises(ConfigError) as e:
        check_job(meta_config("parallel.dp=1", "train.micro_batch_size=8", *more))
    assert str(e.value) == message
