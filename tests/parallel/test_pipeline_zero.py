"""ZeRO inside pipeline stages. ZeRO-2/3 (torchtitan's FSDP + PP): FSDP2 shards each stage's modules over the stage's
dp ranks and reduce-scatters their gradients (no all-reduce), with 1F1B and GPipe; each rank holds a quarter of the
parameters. ZeRO-1: each stage's dp ranks own its parameters' optimizer state between them. dp2 x pp2 equals one
process under plain SGD (per-step loss and grad norm, final weights: the pipeline tolerance, 1e-4)."""

from __future__ import annotations

import json

import pytest

from helpers import PLAIN_SGD, assert_follows, one_process_runs, rank0_params, tiny_gpt_config

SGD = ["train.steps=4", *PLAIN_SGD]


@pytest.fixture(scope="module")
def one(tiny_text, tmp_path_factory):
    """one(*technique): the one-process run of the technique (weights, per-step losses), computed once."""
    return one_process_runs(tiny_text, tmp_path_factory.mktemp("one"), *SGD)


CELLS = {  # the compat matrix's pp2 + ZeRO-3 cells (and ZeRO-2 with GPipe), each against its own one-process run
    "zero3-1f1b": ("parallel.zero=3", "parallel.pp_schedule=1f1b"),
    "zero2-gpipe": ("parallel.zero=2", "parallel.pp_schedule=gpipe"),
    "zero3-checkpointing": ("parallel.zero=3", "train.activation_checkpointing=true"),
    "zero3-lora": ("parallel.zero=3", "finetune.lora_rank=4"),
    "zero3-freeze": ("parallel.zero=3", "finetune.freeze=['blocks.0.*']"),
    "zero3-lamb": ("parallel.zero=3", "optim.name=lamb", "optim.lr=0.01"),
    "zero1-1f1b": ("parallel.zero=1", "parallel.pp_schedule=1f1b"),
    "zero1-gpipe-lamb": ("parallel.zero=1", "parallel.pp_schedule=gpipe", "optim.name=lamb", "optim.lr=0.01"),
}


@pytest.mark.parametrize("cell", list(CELLS))
def test_zero_inside_pipeline_stages_follows_one_process(pool4, tiny_text, tmp_path, one, cell):
    technique = tuple(s for s in CELLS[cell] if not s.startswith("parallel."))
    weights, losses = one(*technique)
    cfg = tiny_gpt_config(tiny_text, "parallel.dp=2", "parallel.pp=2", "train.micro_batch_size=2", *SGD, *CELLS[cell])
    got = pool4.run(rank0_params, cfg, tmp_path / "run")[0]
    assert_follows((weights, losses), got, tmp_path / "run", steps=4, rel=1e-4, atol=1e-4)
    if cell == "zero3-1f1b":  # ZeRO-3 over dp 2 inside each of 2 stages: a quarter of the parameters per rank
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        whole = sum(w.numel() for w in weights.values()) * 4
        per_rank = [r["params_bytes"] for r in summary["memory"]["per_rank"]]
        assert len(per_rank) == 4 and sum(per_rank) >= whole and max(per_rank) <= 0.35 * whole, (per_rank, whole)


def test_zero1_in_pipeline_stages_shards_adamws_state_and_its_checkpoint_resumes_in_one_process(pool4, tiny_text,
                                                                                                 tmp_path):
    """AdamW at dp2 x pp2 + ZeRO-1: a stage's two dp ranks hold its moments between them (8 bytes per parameter in
    all, each rank under 60 %), the run follows one process, and its checkpoint after 2 steps, every rank holding only
    its own part of the state, resumes in one process onto the straight run's weights."""
    from helpers import max_diff, params_after

    adamw = ["optim.name=adamw", "optim.weight_decay=0", "optim.grad_clip=0", "optim.schedule=constant",
             "optim.warmup_steps=0", "log.every=1", "checkpoint.every=2", "train.micro_batch_size=2"]
    straight = params_after(tiny_gpt_config(tiny_text, "parallel.dp=1", "train.steps=4", *adamw), tmp_path / "one")
    layout = ["parallel.dp=2", "parallel.pp=2", "parallel.zero=1"]
    got = pool4.run(rank0_params, tiny_gpt_config(tiny_text, *layout, "train.steps=4", *adamw), tmp_path / "z1")[0]
    assert max_diff(straight, got) < 1e-4
    summary = json.loads((tmp_path / "z1" / "summary.json").read_text())
    state = [r["optimizer_bytes"] for r in summary["memory"]["per_rank"]]  # ranks (pp, dp): 0, 1 stage 0; 2, 3 stage 1
    # two fp32 moments per weight and a step count per tensor; the last stage's tied head has its own
    total = 8 * sum(w.numel() for w in got.values()) + 4 * len(got)
    assert sum(state) == total and max(state) < 0.3 * total, (state, total)
    pool4.run(rank0_params, tiny_gpt_config(tiny_text, *layout, "train.steps=2", *adamw), tmp_path / "half")
    resumed = params_after(tiny_gpt_config(tiny_text, "parallel.dp=1", "train.steps=4", *adamw), tmp_path / "half",
                           resume=True)
    assert max_diff(straight, resumed) < 1e-4
