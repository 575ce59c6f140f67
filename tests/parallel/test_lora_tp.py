"""LoRA (and distillation) under tensor parallel: each adapter split as its layer's weight is (column-parallel: B by output rows, A
whole; row-parallel: A by input columns, B whole), so tp2, dp2 x tp2 and pp2 x tp2 equal one process under plain SGD (per-step
loss and grad norm, weights: 1e-4), with adapters on column- and row-parallel layers both."""

from __future__ import annotations

import pytest
import torch

from helpers import PLAIN_SGD, TP_LAYOUTS, assert_follows, one_process_runs, tiny_gpt_config
from plait.finetune.lora_tp import tp_styles

SGD = ["train.steps=4", *PLAIN_SGD, "finetune.lora_rank=4", "model.vocab_multiple=64",
       "finetune.lora_targets=['*attn.q', '*attn.proj', '*mlp.up', '*mlp.down']"]
LAYOUTS = TP_LAYOUTS


@pytest.fixture(scope="module")
def one(tiny_text, tmp_path_factory):
    return one_process_runs(tiny_text, tmp_path_factory.mktemp("one"), *SGD)


def adapters_split(cfg, run_dir):
    """Pool task: train; rank 0's weights, and each adapter tensor's placement on the rank."""
    from torch.distributed.tensor import DTensor

    from plait.train.trainer import train

    result = train(cfg, run_dir)
    places = {n: str(p.placements[0]) for n, p in result.strategy.module.named_parameters()
              if "lora_" in n and isinstance(p, DTensor)}
    weights = result.strategy.full_model_state_dict()
    return (weights, places) if torch.distributed.get_rank() == 0 else None


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_under_tp_follows_one_process(request, tiny_text, tmp_path, one, name):
    world, layout = LAYOUTS[name]
    pool = request.getfixturevalue(f"pool{world}")
    got, places = pool.run(adapters_split, tiny_gpt_config(tiny_text, *SGD, *layout), tmp_path / "run")[0]
    assert_follows(one(), got, tmp_path / "run", steps=4, rel=1e-4, atol=1e-4)
    assert places["blocks.0.attn.q.lora_B"] == "S(0)" and places["blocks.0.attn.q.lora_A"] == "R"  # column-parallel
    assert places["blocks.0.mlp.down.lora_A"] == "S(1)" and places["blocks.0.mlp.down.lora_B"] == "R"  # row-parallel
    assert any(k.endswith("lora_B") and v.abs().max() > 0 for k, v in got.items())  # the adapters trained


def test_only_plain_column_and_row_styles_change():
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    plan = {"x": ColwiseParallel(), "ln": SequenceParallel()}
    assert tp_styles(torch.nn.Sequential(), plan) == plan  # no LoRA layer: the plan as it was


@pytest.mark.parametrize("layout", [("parallel.dp=2", "parallel.tp=2"), ("parallel.dp=2", "parallel.pp=2", "parallel.zero=3"),
                                    ("parallel.dp=1", "parallel.pp=2", "parallel.tp=2")],
                         ids=["dp2xtp2", "pp2-zero3", "pp2xtp2"])
def test_distillation_at_four_ranks_follows_one_process(pool4, tiny_text, tmp_path, layout):
    """The teacher whole on every rank (in a pipeline: on the last stage, a piece of the local batch per micro-batch),
    the student split (tests/finetune/test_distill.py holds tp2, pp2 and dp2 alone to the same trajectory)."""
    from helpers import params_after, step_losses

    teacher = tmp_path / "teacher"
    params_after(tiny_gpt_config(tiny_text, "parallel.dp=1", "train.steps=6", "checkpoint.every=0"), teacher)
    student = ["train.steps=4", *PLAIN_SGD, "model.width=16", "model.vocab_multiple=64", f"distill.teacher='{teacher}'",
               "distill.alpha=0.7"]
    one = params_after(tiny_gpt_config(tiny_text, "parallel.dp=1", *student), tmp_path / "one")
    got = pool4.run(adapters_split, tiny_gpt_config(tiny_text, *layout, "train.micro_batch_size=2", *student),
                    tmp_path / "run")[0][0]
    assert_follows((one, step_losses(tmp_path / "one")), got, tmp_path / "run", steps=4, rel=1e-5, atol=1e-5)


def test_progressive_freezing_at_dp2_x_tp2_follows_one_process(pool4, tiny_text, tmp_path):
    """Blocks freeze mid-run on split DTensor weights; the by-hand dp average skips what froze (tp2 alone:
    tests/finetune/test_progressive.py)."""
    from helpers import params_after, step_losses

    prog = ["train.steps=4", *PLAIN_SGD, "model.vocab_multiple=64", "finetune.progressive_freeze=true",
            "finetune.progressive_freeze_start=0.25"]
    one = params_after(tiny_gpt_config(tiny_text, "parallel.dp=1", *prog), tmp_path / "one")
    got = pool4.run(adapters_split, tiny_gpt_config(tiny_text, "parallel.dp=2", "parallel.tp=2", "train.micro_batch_size=2",
                                                    *prog), tmp_path / "run")[0][0]
    assert_follows((one, step_losses(tmp_path / "one")), got, tmp_path / "run", steps=4, rel=1e-5, atol=1e-5)


QLORA = ["train.steps=4", *PLAIN_SGD, "finetune.lora_rank=4", "model.vocab_multiple=64", "model.width=128",
         "finetune.quantize_base='nf4'", "finetune.lora_targets=['*attn.q', '*attn.proj', '*mlp.up', '*mlp.down']"]


@pytest.fixture(scope="module")
def one_qlora(tiny_text, tmp_path_factory):
    return one_process_runs(tiny_text, tmp_path_factory.mktemp("one-qlora"), *QLORA)


def nf4_split(cfg, run_dir):
    """Pool task: train; rank 0's weights and the placements of its nf4 codes and scales."""
    from plait.train.trainer import train

    result = train(cfg, run_dir)
    places = {n: str(b.placements[0]) for n, b in result.strategy.module.named_buffers() if "weight_nf4" in n
              or "weight_absmax" in n}
    weights = result.strategy.full_model_state_dict()
    return (weights, places) if torch.distributed.get_rank() == 0 else None


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_qlora_under_tp_follows_one_process(request, tiny_text, tmp_path, one_qlora, name):
    """QLoRA: the nf4 codes and their scales are kept by row (whole 64-value blocks) and split as the weight is, each
    rank dequantizing its own rows (column-parallel) or columns (row-parallel): exactly the one-process QLoRA's
    values, so its trajectory."""
    world, layout = LAYOUTS[name]
    pool = request.getfixturevalue(f"pool{world}")
    got, places = pool.run(nf4_split, tiny_gpt_config(tiny_text, *QLORA, *layout), tmp_path / "run")[0]
    assert_follows(one_qlora(), got, tmp_path / "run", steps=4, rel=1e-4, atol=1e-4)
    assert places["blocks.0.attn.q.weight_nf4"] == places["blocks.0.attn.q.weight_absmax"] == "S(0)"
    assert places["blocks.0.mlp.down.weight_nf4"] == places["blocks.0.mlp.down.weight_absmax"] == "S(1)"
    assert got["blocks.0.mlp.down.weight_nf4"].shape == (128, 256)  # 512 inputs, two codes a byte


def test_an_nf4_base_splits_only_along_its_blocks():
    from torch.distributed.tensor.parallel import RowwiseParallel

    from plait.errors import ConfigError
    from plait.finetune.lora import LoRALinear

    pytest.importorskip("bitsandbytes", reason="bitsandbytes is in the qlora and dev extras")
    model = torch.nn.Sequential(LoRALinear(torch.nn.Linear(64, 8), rank=2, alpha=4, quantize="nf4"))
    assert model[0].weight_nf4.shape == (8, 32) and model[0].weight_absmax.shape == (8, 1)
    with pytest.raises(ConfigError) as e:
        tp_styles(model, {"0": RowwiseParallel()}, tp=2)
    assert str(e.value) == (
        "finetune.quantize_base = 'nf4' with parallel.tp = 2: 0 (8 x 64) would split its nf4 blocks of 64 values (32 "
        "columns of each row on a rank); tensor parallel needs whole blocks on every rank: widen the layer to a "
        "multiple of 128 inputs, leave it out of finetune.lora_targets, or set parallel.tp=1")
