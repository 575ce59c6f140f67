"""[finetune] freeze: frozen parameters get no gradient, optimizer state or gradient traffic, at dp and ZeRO 1/3."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from ft_helpers import assert_same, gpt, run_trajectory

from plait.config import load_config
from plait.errors import ConfigError
from plait.finetune import freeze
from plait.train.job import check_job
from plait.train.weights import load_run_model

FREEZE = "finetune.freeze=['tok_emb*', 'blocks.0.*']"


def test_patterns_freeze_by_name_and_a_pattern_matching_nothing_names_the_closest():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    assert freeze(model, ["0.*"]) == ["0.weight", "0.bias"]
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["2.weight", "2.bias"]
    with pytest.raises(ConfigError, match=r"pattern '2\.wieght' matches no parameter name; the closest are: 2\.weight"):
        freeze(model, ["2.wieght"])


def test_the_job_check_refuses_a_typo_before_any_worker_starts(tiny_text):
    with pytest.raises(ConfigError, match=r"'blocks\.9\.\*' matches no parameter name; the closest are: blocks\."):
        check_job(load_config(None, gpt(tiny_text, "finetune.freeze=['blocks.9.*']")))
    with pytest.raises(ConfigError, match="supported with data, tensor, pipeline, context and expert parallel and ZeRO 1-3"):
        check_job(load_config(None, gpt(tiny_text, "finetune.lora_rank=4", "parallel.sync=gossip")))
    assert check_job(load_config(None, gpt(tiny_text, FREEZE, "parallel.dp=1", "parallel.tp=2",
                                           "model.vocab_multiple=64"))).tp == 2  # a fixed freeze: tests/parallel/test_freeze_tp.py


def _frozen_names(params: dict) -> list[str]:
    return [k for k in params if k.startswith(("tok_emb.", "head.", "blocks.0."))]


@pytest.fixture(scope="module")
def reference(pretrained, tiny_text, tmp_path_factory):
    cfg = load_config(None, gpt(tiny_text, "parallel.dp=1", FREEZE, f"train.init_from='{pretrained}'"))
    return run_trajectory(cfg, tmp_path_factory.mktemp("freeze-ref"))


def test_frozen_parameters_do_not_move_and_the_rest_trains(reference, pretrained):
    losses, _, params, summary = reference
    _, _, start = load_run_model(pretrained)
    start = start.state_dict()
    frozen = _frozen_names(params)
    assert frozen and all(torch.equal(params[k], start[k]) for k in frozen)
    assert all(not torch.equal(params[k], start[k]) for k in params if k not in frozen and k.endswith("weight"))
    assert losses[-1] < losses[0]
    total = summary["params"]
    emb = start["tok_emb.weight"].numel()  # tied with head.weight: one parameter
    block0 = sum(v.numel() for k, v in start.items() if k.startswith("blocks.0."))
    assert summary["trainable_params"] == total - emb - block0


@pytest.mark.parametrize("layout", [("parallel.dp=2",), ("parallel.dp=2", "parallel.zero=1"),
                                    ("parallel.dp=2", "parallel.zero=3")], ids=["dp2", "zero1", "zero3"])
def test_freezing_keeps_the_single_process_trajectory(pool2, reference, pretrained, tiny_text, tmp_path, layout):
    cfg = load_config(None, gpt(tiny_text, *layout, FREEZE, f"train.init_from='{pretrained}'"))
    assert_same(reference, pool2.run(run_trajectory, cfg, tmp_path)[0])


def _per_step(pool2, cfg_of, tmp_path) -> tuple[dict, float]:
    """(summary, bytes sent per step): the difference of a 3- and a 6-step run cancels what a run sends once
    (DDP's set-up, the final evaluation's gathers), leaving the bytes of one more step."""
    runs = {n: pool2.run(run_trajectory, cfg_of(n), tmp_path / f"s{n}")[0][3] for n in (3, 6)}
    total = {n: s["comm"]["bytes_per_step_per_rank"][0] * n for n, s in runs.items()}
    return runs[3], (total[6] - total[3]) / 3


def test_optimizer_bytes_and_gradient_traffic_fall_by_the_frozen_share(pool2, tiny_text, tmp_path):
    """AdamW at dp=2 (DDP): optimizer state = 2 fp32 moments per trainable element (+ a step scalar per tensor),
    and each step's all-reduce sends 2 (n-1)/n = 1 x the trainable gradient bytes (+ the 24-byte all-gather of
    the logged loss): both fall by exactly the frozen parameters' share."""
    def cfg_of(*more):
        return lambda n: load_config(None, gpt(tiny_text, "parallel.dp=2", "optim.name='adamw'", "optim.lr=3e-3",
                                               f"train.steps={n}", *more))
    full, sent_full = _per_step(pool2, cfg_of(), tmp_path / "full")
    frozen, sent_frozen = _per_step(pool2, cfg_of(FREEZE), tmp_path / "frozen")
    n_frozen = full["trainable_params"] - frozen["trainable_params"]
    assert n_frozen > 0.5 * full["params"]
    tensors = lambda s: (s["memory"]["per_rank"][0]["optimizer_bytes"] - 8 * s["trainable_params"]) / 4
    assert tensors(full) == 1 + 1 + 2 * 16 + 2  # step scalars: tok_emb (tied head), pos_emb, 16 per block, ln_f
    assert tensors(frozen) == 1 + 16 + 2  # pos_emb, block 1, ln_f
    for summary, sent in ((full, sent_full), (frozen, sent_frozen)):
        assert sent == pytest.approx(4 * summary["trainable_params"] + 24, abs=1e-6), (sent, summary["trainable_params"])
