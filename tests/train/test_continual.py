"""Continual learning (data.stream): the task-by-task sampler with replay, EWC against its formula, the forgetting
table, dp / ZeRO-3 on the one-process trajectory, and a resume across a task boundary."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import PLAIN_SGD, assert_follows, params_after, rank0_params, step_losses
from plait.config import load_config
from plait.data.datasets import Tensors
from plait.data.sources import build_data
from plait.data.stream import Concat, StreamSampler, stream_bundle
from plait.errors import ConfigError
from plait.report.html import forgetting_table
from plait.train.continual import Continual, empirical_fisher
from plait.train.job import check_job

SPLIT = "data.stream=[{classes=[0,1,2,3,4]},{classes=[5,6,7,8,9]}]"
STREAM = ["data.name=digits", "model.name=mlp", "model.width=16", "model.depth=2", SPLIT, "train.steps=6",
          "train.global_batch_size=8", "train.eval_samples=16", "train.eval_batch_size=4", "train.eval_every=0",
          "log.progress=false", "log.report=false", "log.every=1", "data.replay=0.25", "train.ewc=50",
          "train.ewc_samples=16", *PLAIN_SGD]


def table_values(table: dict) -> list[float]:
    return [v for r in table["rows"] for v in r["values"]]


def stream_config(*more: str):
    return load_config(None, [*STREAM, *more])


def test_the_sampler_goes_task_by_task_and_replays_only_earlier_tasks():
    s = StreamSampler([40, 30, 20], global_batch_size=8, seed=3, steps=10, replay=0.25)
    assert [s.task_at(k) for k in range(10)] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2] and s.boundaries() == [4, 7]
    for step in range(10):
        b = s.global_batch(step)
        assert len(b) == 8 and torch.equal(b, StreamSampler([40, 30, 20], 8, 3, 10, 0.25).global_batch(step))
        t = s.task_at(step)
        now, old = (b, b[:0]) if t == 0 else (b[:6], b[6:])
        assert all(s.offsets[t] <= int(i) < s.offsets[t] + s.sizes[t] for i in now)
        assert all(0 <= int(i) < s.offsets[t] for i in old)
    x = torch.arange(10.0)[:, None]
    whole = Concat([Tensors(x[:4], torch.arange(4)), Tensors(x[4:], torch.arange(4, 10))])
    got, y = whole.fetch(torch.tensor([7, 0, 4, 3]))
    assert got.flatten().tolist() == [7.0, 0.0, 4.0, 3.0] and y.tolist() == [7, 0, 4, 3]


def test_the_fisher_is_the_mean_squared_per_sample_gradient():
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    got = empirical_fisher(model, Tensors(x, y), F.cross_entropy, samples=12, seed=1)
    p = torch.softmax(model(x), -1).detach()
    d = p - F.one_hot(y, 3)  # d(-log p_y)/d logits, per sample
    torch.testing.assert_close(got["weight"], torch.einsum("nc,nf->cf", d ** 2, x ** 2) / 12)
    torch.testing.assert_close(got["bias"], (d ** 2).mean(0))


def test_ewc_adds_lambda_fisher_times_the_distance_to_each_anchor():
    model = nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    cb = Continual.__new__(Continual)
    cb.strategy, cb.lam = SimpleNamespace(module=model), 3.0
    cb.anchors = [({n: torch.rand_like(p) for n, p in model.named_parameters()},
                   {n: torch.randn_like(p) for n, p in model.named_parameters()}) for _ in range(2)]
    cb.after_compute(5, 0.0, 8)
    for n, p in model.named_parameters():
        want = before[n] + sum(3.0 * f[n] * (p.detach() - a[n]) for f, a in cb.anchors)
        torch.testing.assert_close(p.grad, want)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run = tmp_path_factory.mktemp("stream") / "one"
    weights = params_after(stream_config("parallel.dp=1", "train.micro_batch_size=4"), run)
    return weights, step_losses(run), json.loads((run / "summary.json").read_text())["continual"]


@pytest.mark.parametrize("zero", [0, 3], ids=["ddp", "zero3"])
def test_continual_learning_with_replay_and_ewc_follows_one_process(pool2, tmp_path, one_process, zero):
    run = tmp_path / "dp2"
    got = pool2.run(rank0_params, stream_config("parallel.dp=2", f"parallel.zero={zero}", "train.micro_batch_size=2"),
                    run)[0]
    assert_follows(one_process[:2], got, run, steps=6, rel=1e-5, atol=1e-6)
    table = json.loads((run / "summary.json").read_text())["continual"]
    assert table_values(table) == pytest.approx(table_values(one_process[2]))
    assert [(r["after_task"], r["step"]) for r in table["rows"]] == [(0, 3), (1, 6)]


def test_a_resume_after_the_boundary_keeps_the_consolidated_task(tmp_path, one_process):
    run = tmp_path / "resumed"
    params_after(stream_config("parallel.dp=1", "train.micro_batch_size=4", "train.stop_after=4",
                               "checkpoint.every=1"), run)
    assert (run / "continual" / "task0.safetensors").is_file()
    got = params_after(stream_config("parallel.dp=1", "train.micro_batch_size=4", "checkpoint.every=1"), run,
                       resume=True)
    assert max((got[k] - one_process[0][k]).abs().max().item() for k in got) < 1e-6
    table = json.loads((run / "summary.json").read_text())["continual"]
    assert table_values(table) == pytest.approx(table_values(one_process[2]))


def test_the_report_shows_the_forgetting_table():
    page = forgetting_table({"metric": "val_accuracy", "replay": 0.25, "ewc": 0.0, "forgetting": [0.125, None],
                             "rows": [{"after_task": 0, "step": 3, "values": [0.875, 0.0]},
                                      {"after_task": 1, "step": 6, "values": [0.75, 0.5]}]})
    assert ("<tr><th>after task 1 (step 6)</th><td class=n>0.750</td><td class=n>0.500</td></tr>"
            "<tr><th>forgetting</th><td class=n>0.125</td><td class=n></td></tr>") in page


def test_a_data_version_can_exclude_what_an_audit_flagged(tmp_path):
    audit = tmp_path / "audit.json"
    first = build_data(stream_config().data, stream_config().model)
    flagged = first.train.source_index[:5].tolist()
    audit.write_text(json.dumps({"exclude": flagged}))
    cfg = stream_config(f"data.stream=[{{}}, {{exclude = '{audit}'}}]")
    bundle = stream_bundle(cfg.data, cfg.model, build_data)
    (v1, val1), (v2, val2) = bundle.tasks
    assert len(v1) == len(first.train) and len(v2) == len(v1) - 5 and len(val1) == len(val2)
    assert not set(flagged) & set(v2.source_index.tolist())


@pytest.mark.parametrize("more, message", [
    (["data.stream=[]", "data.replay=0"], "train.ewc consolidates the tasks of data.stream; set data.stream or train.ewc=0"),
    (["data.stream=[{classes=[0]}, {colour='red'}]"],
     "data.stream[1] sets ['colour'], which are not [data] keys a task can set; use keys such as classes, path, "
     "exclude or name"),
    (["data.replay=1.0"], "data.replay = 1.0 must be below 1 (it is the share of each batch drawn from earlier tasks), "
                          "e.g. 0.25"),
])
def test_continual_learning_refuses_what_it_cannot_do(more, message):
    with pytest.raises(ConfigError) as e:
        check_job(stream_config("parallel.dp=1", "train.micro_batch_size=8", *more))
    assert str(e.value) == message
