"""Freezing, LoRA and QLoRA under pipeline parallel: the tiny GPT (tied embedding and head, one on each stage) at
pp = 2 follows one process with the same fine-tuning under plain SGD (tests/parallel/test_equivalence.py's
tolerances). A frozen tied weight has no gradient on either stage, so the stages skip summing it."""

from __future__ import annotations

import pytest

from plait.config import load_config

METHODS = {
    "lora": ("finetune.lora_rank=4", "finetune.lora_alpha=8"),
    "qlora": ("finetune.lora_rank=4", "finetune.lora_alpha=8", "finetune.quantize_base='nf4'"),
    "freeze": ("finetune.freeze=['blocks.0.*', 'tok_emb.*']",),
}


@pytest.fixture(scope="module")
def eq():
    import importlib

    return importlib.import_module("test_equivalence")


@pytest.fixture(scope="module")
def base(tiny_text, eq):
    from helpers import TINY_GPT

    return (*TINY_GPT, *eq.GPT, f"data.path='{tiny_text}'", *eq.SGD)


@pytest.mark.parametrize("method,schedule", [("lora", "1f1b"), ("lora", "gpipe"), ("qlora", "1f1b"), ("freeze", "1f1b")])
def test_fine_tuning_under_pipeline_parallel_keeps_the_trajectory(pool2, eq, base, tmp_path, method, schedule):
    ref = eq.trajectory(load_config(None, [*base, "parallel.dp=1", *METHODS[method]]), tmp_path / "ref")
    got = pool2.run(eq.trajectory, load_config(None, [*base, "parallel.dp=1", "parallel.pp=2",
                                                      f"parallel.pp_schedule='{schedule}'", *METHODS[method]]),
                    tmp_path / "pp")[0]
    eq.assert_same_trajectory(ref, got)
