"""ZeRO-2/3 inside pipeline stages (torchtitan's FSDP + PP): FSDP2 shards each stage's modules over the stage's dp
ranks and reduce-scatters their gradients (no all-reduce), with 1F1B and GPipe; dp2 x pp2 equals one process under
plain SGD (per-step loss and grad norm, final weights: the pipeline tolerance, 1e-4), and each rank holds a quarter
of the parameters."""

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
