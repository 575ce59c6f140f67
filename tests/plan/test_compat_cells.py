"""Every ✔ cell of the composition matrix (docs/compat.md, `plait compat`) has a test that trains the technique at
the layout and checks it: most in the scheme's or technique's own test file (COVERED names one for each), the rest
here, each against one process running the same technique under plain SGD on the tiny GPT (per-step loss and grad
norm, final weights), or, where the technique itself changes the numbers, within its stated tolerance: fp16
compression against the uncompressed run (fp16's rounding of the gradients), PowerSGD within 10 % of it (a rank-2
approximation), fp16 loss scaling and 8-bit state on sharded tensors (their rounding)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest

from helpers import (
    PLAIN_SGD,
    assert_follows,
    eager,
    eager_rank0_params,
    one_process_runs,
    rank0_params,
    step_losses,
    tiny_gpt_config,
)
from plait.plan.compat import LAYOUTS, TECHNIQUES

ROOT = Path(__file__).resolve().parents[2]

COVERED = {  # (technique, layout): a test elsewhere that trains the technique at the layout and checks it
    ('plain SGD/AdamW', '1 process'): "tests/parallel/test_equivalence.py::test_the_reference_trains_and_a_2x_gradient_error_shows",
    ('plain SGD/AdamW', 'dp2'): "tests/parallel/test_equivalence.py::test_two_rank_layouts[dp2]",
    ('plain SGD/AdamW', 'ZeRO-1'): "tests/parallel/test_equivalence.py::test_two_rank_layouts[dp2-zero1]",
    ('plain SGD/AdamW', 'ZeRO-2'): "tests/parallel/test_equivalence.py::test_two_rank_layouts[dp2-zero2]",
    ('plain SGD/AdamW', 'ZeRO-3'): "tests/parallel/test_equivalence.py::test_two_rank_layouts[dp2-zero3]",
    ('plain SGD/AdamW', 'tp2'): "tests/parallel/test_equivalence.py::test_two_rank_layouts[tp2]",
    ('plain SGD/AdamW', 'pp2'): "tests/parallel/test_equivalence.py::test_two_rank_layouts[pp2-gpipe]",
    ('plain SGD/AdamW', 'dp2 x tp2'): "tests/parallel/test_equivalence.py::test_four_rank_layouts[dp2xtp2]",
    ('plain SGD/AdamW', 'pp2 + ZeRO-3'):
        "tests/parallel/test_pipeline_zero.py::test_zero_inside_pipeline_stages_follows_one_process[zero3-1f1b]",
    ('plain SGD/AdamW', 'pp2 x tp2'): "tests/parallel/test_equivalence.py::test_four_rank_layouts[pp2xtp2]",
    ('plain SGD/AdamW', 'ep2'): "tests/parallel/test_expert.py::test_expert_parallel_follows_one_process[dp2-ep2]",
    ('plain SGD/AdamW', 'cp2'): "tests/parallel/test_context.py::test_two_rank_cp_layouts_keep_the_trajectory[cp2-gpt]",
    ('plain SGD/AdamW', 'cp2 + ZeRO-3'):
        "tests/parallel/test_context.py::test_two_rank_cp_layouts_keep_the_trajectory[cp2-zero3-gpt]",
    ('activation checkpointing', '1 process'):
        "tests/parallel/test_equivalence.py::test_one_process_variants[activation-checkpointing]",
    ('activation checkpointing', 'ZeRO-1'): "tests/parallel/test_equivalence.py::test_two_rank_layouts[dp2-zero1-ckpt]",
    ('activation checkpointing', 'ZeRO-2'): "tests/parallel/test_equivalence.py::test_two_rank_layouts[dp2-zero2-ckpt]",
    ('activation checkpointing', 'ZeRO-3'): "tests/parallel/test_equivalence.py::test_two_rank_layouts[dp2-zero3-ckpt]",
    ('activation checkpointing', 'pp2'): "tests/parallel/test_expert.py::test_moe_blocks_in_pipeline_stages[pp2-gpipe-ckpt]",
    ('activation checkpointing', 'pp2 + ZeRO-3'):
        "tests/parallel/test_pipeline_zero.py::test_zero_inside_pipeline_stages_follows_one_process[zero3-checkpointing]",
    ('activation checkpointing', 'cp2'):
        "tests/parallel/test_context.py::test_two_rank_cp_layouts_keep_the_trajectory[cp2-ckpt-gpt]",
    ('LoRA', '1 process'): "tests/finetune/test_lora.py::test_lora_matches_peft_on_the_same_layer_with_the_same_weights",
    ('LoRA', 'dp2'): "tests/finetune/test_lora.py::test_only_adapters_train_and_dp_and_zero3_keep_the_trajectory",
    ('LoRA', 'ZeRO-3'): "tests/finetune/test_lora.py::test_only_adapters_train_and_dp_and_zero3_keep_the_trajectory",
    ('LoRA', 'tp2'): "tests/parallel/test_lora_tp.py::test_lora_under_tp_follows_one_process[tp2]",
    ('LoRA', 'pp2'):
        "tests/parallel/test_finetune_pipeline.py::test_fine_tuning_under_pipeline_parallel_keeps_the_trajectory[lora-1f1b]",
    ('LoRA', 'dp2 x tp2'): "tests/parallel/test_lora_tp.py::test_lora_under_tp_follows_one_process[dp2xtp2]",
    ('LoRA', 'pp2 + ZeRO-3'):
        "tests/parallel/test_pipeline_zero.py::test_zero_inside_pipeline_stages_follows_one_process[zero3-lora]",
    ('LoRA', 'pp2 x tp2'): "tests/parallel/test_lora_tp.py::test_lora_under_tp_follows_one_process[pp2xtp2]",
    ('LoRA', 'ep2'): "tests/parallel/test_finetune_ep.py::test_fine_tuning_with_expert_parallel_follows_one_process[lora]",
    ('LoRA', 'cp2'): "tests/parallel/test_context.py::test_lora_under_cp_keeps_the_trajectory",
    ('QLoRA (nf4 base)', '1 process'):
        "tests/finetune/test_qlora.py::test_an_nf4_base_takes_one_eighth_of_fp32_plus_a_scale_per_64_values",
    ('QLoRA (nf4 base)', 'ZeRO-3'): "tests/finetune/test_qlora.py::test_zero3_shards_the_nf4_base_with_its_scales",
    ('QLoRA (nf4 base)', 'tp2'): "tests/parallel/test_lora_tp.py::test_qlora_under_tp_follows_one_process[tp2]",
    ('QLoRA (nf4 base)', 'pp2'):
        "tests/parallel/test_finetune_pipeline.py::test_fine_tuning_under_pipeline_parallel_keeps_the_trajectory[qlora-1f1b]",
    ('QLoRA (nf4 base)', 'dp2 x tp2'): "tests/parallel/test_lora_tp.py::test_qlora_under_tp_follows_one_process[dp2xtp2]",
    ('QLoRA (nf4 base)', 'pp2 x tp2'): "tests/parallel/test_lora_tp.py::test_qlora_under_tp_follows_one_process[pp2xtp2]",
    ('QLoRA (nf4 base)', 'ep2'):
        "tests/parallel/test_finetune_ep.py::test_fine_tuning_with_expert_parallel_follows_one_process[qlora]",
    ('freeze', '1 process'): "tests/finetune/test_freeze.py::test_frozen_parameters_do_not_move_and_the_rest_trains",
    ('freeze', 'dp2'): "tests/finetune/test_freeze.py::test_freezing_keeps_the_single_process_trajectory[dp2]",
    ('freeze', 'ZeRO-1'): "tests/finetune/test_freeze.py::test_freezing_keeps_the_single_process_trajectory[zero1]",
    ('freeze', 'ZeRO-3'): "tests/finetune/test_freeze.py::test_freezing_keeps_the_single_process_trajectory[zero3]",
    ('freeze', 'tp2'): "tests/parallel/test_freeze_tp.py::test_freezing_under_tp_follows_one_process[tp2]",
    ('freeze', 'pp2'):
        "tests/parallel/test_finetune_pipeline.py::test_fine_tuning_under_pipeline_parallel_keeps_the_trajectory[freeze-1f1b]",
    ('freeze', 'dp2 x tp2'): "tests/parallel/test_freeze_tp.py::test_freezing_under_tp_follows_one_process[dp2xtp2]",
    ('freeze', 'pp2 + ZeRO-3'):
        "tests/parallel/test_pipeline_zero.py::test_zero_inside_pipeline_stages_follows_one_process[zero3-freeze]",
    ('freeze', 'pp2 x tp2'): "tests/parallel/test_freeze_tp.py::test_freezing_under_tp_follows_one_process[pp2xtp2]",
    ('freeze', 'ep2'):
        "tests/parallel/test_finetune_ep.py::test_fine_tuning_with_expert_parallel_follows_one_process[freeze-experts]",
    ('progressive freeze', '1 process'):
        "tests/finetune/test_progressive.py::test_frozen_blocks_keep_their_weights_from_their_step_while_the_rest_trains",
    ('progressive freeze', 'dp2'):
        "tests/finetune/test_progressive.py::test_dp2_follows_the_single_process_trajectory_and_sends_only_what_trains",
    ('progressive freeze', 'ZeRO-1'):
        "tests/finetune/test_progressive.py::test_zero_2_and_3_follow_it_too_and_stop_reduce_scattering_what_froze[zero1]",
    ('progressive freeze', 'ZeRO-2'):
        "tests/finetune/test_progressive.py::test_zero_2_and_3_follow_it_too_and_stop_reduce_scattering_what_froze[zero2]",
    ('progressive freeze', 'ZeRO-3'):
        "tests/finetune/test_progressive.py::test_zero_2_and_3_follow_it_too_and_stop_reduce_scattering_what_froze[zero3]",
    ('progressive freeze', 'tp2'):
        "tests/finetune/test_progressive.py::test_zero_2_and_3_follow_it_too_and_stop_reduce_scattering_what_froze[tp2]",
    ('progressive freeze', 'pp2'):
        "tests/finetune/test_progressive.py::test_pipeline_stages_freeze_the_blocks_they_hold_on_the_whole_models_schedule[pp2]",
    ('progressive freeze', 'dp2 x tp2'):
        "tests/parallel/test_lora_tp.py::test_progressive_freezing_at_dp2_x_tp2_follows_one_process",
    ('progressive freeze', 'pp2 + ZeRO-3'):
        "tests/finetune/test_progressive.py::test_pipeline_stages_freeze_the_blocks_they_hold_on_the_whole_models_schedule[dp2xpp2-zero3]",
    ('progressive freeze', 'pp2 x tp2'):
        "tests/finetune/test_progressive.py::test_pipeline_stages_freeze_the_blocks_they_hold_on_the_whole_models_schedule[pp2xtp2]",
    ('progressive freeze', 'ep2'):
        "tests/parallel/test_finetune_ep.py::test_fine_tuning_with_expert_parallel_follows_one_process[progressive]",
    ('progressive freeze', 'cp2 + ZeRO-3'):
        "tests/finetune/test_progressive.py::test_zero_2_and_3_follow_it_too_and_stop_reduce_scattering_what_froze[cp2-zero3]",
    ('mixture of experts', '1 process'):
        "tests/models/test_moe.py::test_outputs_and_every_gradient_match_the_token_by_token_reference",
    ('mixture of experts', 'dp2'): "tests/parallel/test_expert.py::test_resume_ep2_to_ep1_and_back",
    ('mixture of experts', 'tp2'): "tests/parallel/test_expert.py::test_moe_blocks_stay_whole_under_tensor_parallel[tp2]",
    ('mixture of experts', 'pp2'): "tests/parallel/test_expert.py::test_moe_blocks_in_pipeline_stages[pp2]",
    ('mixture of experts', 'dp2 x tp2'): "tests/parallel/test_expert.py::test_moe_blocks_stay_whole_under_tensor_parallel[dp2-tp2]",
    ('mixture of experts', 'pp2 + ZeRO-3'): "tests/parallel/test_expert.py::test_moe_blocks_in_pipeline_stages[pp2-zero3]",
    ('mixture of experts', 'pp2 x tp2'): "tests/parallel/test_expert.py::test_moe_blocks_in_pipeline_stages[pp2-tp2]",
    ('mixture of experts', 'ep2'): "tests/parallel/test_expert.py::test_expert_parallel_follows_one_process[dp2-ep2]",
    ('adamw8bit', '1 process'): "tests/finetune/test_adamw8bit.py::test_adamw8bit_states_take_under_0_3_of_adamw_and_train_alike",
    ('adamw8bit', 'ZeRO-1'): "tests/finetune/test_adamw8bit.py::test_adamw8bit_under_zero1_steps_whole_tensors_like_one_process",
    ('adamw8bit', 'ZeRO-2'):
        "tests/finetune/test_adamw8bit.py::test_adamw8bit_under_zero2_and_zero3_quantizes_each_shard_and_follows_one_process",
    ('adamw8bit', 'ZeRO-3'):
        "tests/finetune/test_adamw8bit.py::test_adamw8bit_under_zero2_and_zero3_quantizes_each_shard_and_follows_one_process",
    ('adamw8bit', 'tp2'): "tests/finetune/test_adamw8bit.py::test_adamw8bit_under_tensor_parallel_quantizes_each_shard[tp2]",
    ('adamw8bit', 'dp2 x tp2'):
        "tests/finetune/test_adamw8bit.py::test_adamw8bit_under_tensor_parallel_quantizes_each_shard[dp2xtp2]",
    ('adamw8bit', 'pp2 x tp2'):
        "tests/finetune/test_adamw8bit.py::test_adamw8bit_under_tensor_parallel_quantizes_each_shard[pp2xtp2]",
    ('LAMB', '1 process'): "tests/finetune/test_optimizers.py::test_lamb_and_lars_follow_their_update_formulas[random]",
    ('LAMB', 'dp2'):
        "tests/finetune/test_optimizers.py::test_lamb_trains_the_same_at_dp2_and_zero1_and_zero2_3_accept_layerwise_optimizers[0]",
    ('LAMB', 'ZeRO-1'):
        "tests/finetune/test_optimizers.py::test_lamb_trains_the_same_at_dp2_and_zero1_and_zero2_3_accept_layerwise_optimizers[1]",
    ('LAMB', 'ZeRO-2'): "tests/parallel/test_zero_lamb.py::test_per_tensor_norm_optimizers_under_zero_follow_one_process[lamb]",
    ('LAMB', 'ZeRO-3'): "tests/parallel/test_zero_lamb.py::test_per_tensor_norm_optimizers_under_zero_follow_one_process[lamb]",
    ('LAMB', 'pp2 + ZeRO-3'):
        "tests/parallel/test_pipeline_zero.py::test_zero_inside_pipeline_stages_follows_one_process[zero3-lamb]",
    ('fp16 compression', 'dp2'): "tests/comm/test_comm_compression.py::test_training_with_each_compression_converges_on_digits",
    ('fp16 compression', 'ZeRO-1'):
        "tests/parallel/test_zero_compression.py::test_compressed_reduce_scatter_sends_half_and_keeps_the_trajectory[1-fp16-0.002]",
    ('fp16 compression', 'ZeRO-3'):
        "tests/parallel/test_zero_compression.py::test_compressed_reduce_scatter_sends_half_and_keeps_the_trajectory[3-fp16-0.002]",
    ('fp16 compression', 'dp2 x tp2'):
        "tests/parallel/test_zero_compression.py::test_fp16_compression_of_a_tensor_parallel_models_dp_average",
    ('fp16 compression', 'ep2'):
        "tests/parallel/test_zero_compression.py::test_fp16_compression_of_the_dense_part_under_expert_parallel",
    ('PowerSGD', 'dp2'): "tests/comm/test_comm_compression.py::test_training_with_each_compression_converges_on_digits",
    ('PowerSGD', 'ZeRO-1'):
        "tests/parallel/test_compression_layouts.py::test_low_rank_powersgd_under_zero_is_the_exact_average[layout0]",
    ('PowerSGD', 'ZeRO-2'):
        "tests/parallel/test_compression_layouts.py::test_low_rank_powersgd_under_zero_is_the_exact_average[layout1]",
    ('PowerSGD', 'ZeRO-3'):
        "tests/parallel/test_compression_layouts.py::test_low_rank_powersgd_under_zero_is_the_exact_average[layout2]",
    ('PowerSGD', 'dp2 x tp2'): "tests/parallel/test_compression_layouts.py::test_powersgd_of_tensor_parallel_shards_along_dp",
    ('PowerSGD', 'pp2 + ZeRO-3'):
        "tests/parallel/test_compression_layouts.py::test_topk_and_powersgd_of_zero3_inside_pipeline_stages",
    ('PowerSGD', 'ep2'):
        "tests/parallel/test_zero_compression.py::test_topk_and_powersgd_of_the_dense_part_under_expert_parallel[powersgd]",
    ('PowerSGD', 'cp2 + ZeRO-3'):
        "tests/parallel/test_compression_layouts.py::test_topk_and_powersgd_of_zero3_with_context_parallel",
    ('top-k compression', 'dp2'): "tests/comm/test_comm_compression.py::test_training_with_each_compression_converges_on_digits",
    ('top-k compression', 'ZeRO-1'):
        "tests/parallel/test_zero_compression.py::test_topk_of_zero1s_flat_buffer_and_of_tp_shards_along_dp[zero1]",
    ('top-k compression', 'ZeRO-2'): "tests/parallel/test_compression_layouts.py::test_topk_of_zero_reduce_scatters[2]",
    ('top-k compression', 'ZeRO-3'): "tests/parallel/test_compression_layouts.py::test_topk_of_zero_reduce_scatters[3]",
    ('top-k compression', 'dp2 x tp2'):
        "tests/parallel/test_zero_compression.py::test_topk_of_zero1s_flat_buffer_and_of_tp_shards_along_dp[dp2xtp2]",
    ('top-k compression', 'pp2 + ZeRO-3'):
        "tests/parallel/test_compression_layouts.py::test_topk_and_powersgd_of_zero3_inside_pipeline_stages",
    ('top-k compression', 'ep2'):
        "tests/parallel/test_zero_compression.py::test_topk_and_powersgd_of_the_dense_part_under_expert_parallel[topk]",
    ('top-k compression', 'cp2 + ZeRO-3'):
        "tests/parallel/test_compression_layouts.py::test_topk_and_powersgd_of_zero3_with_context_parallel",
    ('optimizer offload (disk)', '1 process'):
        "tests/parallel/test_offload.py::test_disk_offload_lowers_peak_rss_by_about_the_optimizer_bytes",
    ('optimizer offload (disk)', 'ZeRO-1'):
        "tests/parallel/test_offload.py::test_disk_offload_with_zero1_keeps_the_trajectory_and_resumes",
    ('optimizer offload (disk)', 'ZeRO-2'):
        "tests/parallel/test_offload.py::test_disk_offload_of_sharded_and_staged_parameters_is_the_same_adamw[zero2]",
    ('optimizer offload (disk)', 'ZeRO-3'):
        "tests/parallel/test_offload.py::test_disk_offload_of_sharded_and_staged_parameters_is_the_same_adamw[zero3]",
    ('optimizer offload (disk)', 'tp2'):
        "tests/parallel/test_offload.py::test_disk_offload_of_sharded_and_staged_parameters_is_the_same_adamw[tp2]",
    ('optimizer offload (disk)', 'pp2'):
        "tests/parallel/test_offload.py::test_disk_offload_of_sharded_and_staged_parameters_is_the_same_adamw[pp2]",
    ('optimizer offload (disk)', 'dp2 x tp2'):
        "tests/parallel/test_offload.py::test_disk_offload_of_sharded_and_staged_parameters_is_the_same_adamw[dp2xtp2]",
    ('optimizer offload (disk)', 'pp2 + ZeRO-3'):
        "tests/parallel/test_offload.py::test_disk_offload_of_sharded_and_staged_parameters_is_the_same_adamw[pp2-zero3]",
    ('optimizer offload (disk)', 'pp2 x tp2'):
        "tests/parallel/test_offload.py::test_disk_offload_of_sharded_and_staged_parameters_is_the_same_adamw[pp2xtp2]",
    ('optimizer offload (disk)', 'ep2'):
        "tests/parallel/test_offload.py::test_disk_offload_of_sharded_and_staged_parameters_is_the_same_adamw[ep2]",
    ('optimizer offload (disk)', 'cp2 + ZeRO-3'):
        "tests/parallel/test_offload.py::test_disk_offload_of_sharded_and_staged_parameters_is_the_same_adamw[cp2-zero3]",
    ('fp16 loss scaling', '1 process'): "tests/train/test_trainer.py::test_fp16_uses_a_loss_scaler_that_is_checkpointed",
    ('fp16 loss scaling', 'ep2'): "tests/parallel/test_expert_fp16.py::test_ep2_fp16_follows_dp2_fp16",
    ('distillation', '1 process'): "tests/finetune/test_distill.py::test_soft_loss_is_t_squared_kl_averaged_over_tokens",
    ('distillation', 'dp2'): "tests/finetune/test_distill.py::test_a_distilled_student_follows_one_trajectory_at_dp2",
    ('distillation', 'tp2'):
        "tests/finetune/test_distill.py::test_a_distilled_student_under_tensor_and_pipeline_parallel_follows_one_process",
    ('distillation', 'pp2'):
        "tests/finetune/test_distill.py::test_a_distilled_student_under_tensor_and_pipeline_parallel_follows_one_process",
    ('distillation', 'dp2 x tp2'): "tests/parallel/test_lora_tp.py::test_distillation_at_four_ranks_follows_one_process[dp2xtp2]",
    ('distillation', 'pp2 + ZeRO-3'):
        "tests/parallel/test_lora_tp.py::test_distillation_at_four_ranks_follows_one_process[pp2-zero3]",
    ('distillation', 'pp2 x tp2'): "tests/parallel/test_lora_tp.py::test_distillation_at_four_ranks_follows_one_process[pp2xtp2]",
}


WORLD = {"1 process": 1, "dp2 x tp2": 4, "pp2 + ZeRO-3": 4, "pp2 x tp2": 4}  # the rest: 2 ranks
BASE = ["train.steps=3", "train.micro_batch_size=2", "model.vocab_multiple=64", *PLAIN_SGD]
# what a cell's run adds to the technique's keys: a learning rate for LAMB's trust ratio, AdamW for the offloaded state
# (SGD has none), every entry for top-k (exact then: the sparse sends are tests/comm's), a freeze schedule in 3 steps
EXTRA = {"LAMB": ("optim.lr=0.01",), "optimizer offload (disk)": ("optim.name=adamw", "optim.lr=3e-3"),
         "adamw8bit": ("optim.lr=0.01",), "top-k compression": ("parallel.topk_ratio=1.0",),
         "progressive freeze": ("finetune.progressive_freeze_start=0.3",)}
# (rel on loss and grad norm, atol on weights): exact techniques at the split layouts' 1e-4
TOL = {"fp16 compression": (2e-3, 2e-3), "fp16 loss scaling": (1e-2, 1e-2), "adamw8bit": (1e-3, 5e-3)}
UNCOMPRESSED = ("fp16 compression", "PowerSGD", "top-k compression")  # reference: one process without them


def accepted() -> set[tuple[str, str]]:
    """The ✔ cells of docs/compat.md (tests/plan/test_compat.py holds it equal to the job check's matrix)."""
    text = (ROOT / "docs" / "compat.md").read_text()
    layouts = [lay for lay, _ in LAYOUTS]
    out = set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(layouts) + 1 and cells[0] in dict(TECHNIQUES):
            out |= {(cells[0], lay) for lay, c in zip(layouts, cells[1:]) if c == "✔"}
    return out


RUN_HERE = sorted(accepted() - set(COVERED), key=lambda c: ([t for t, _ in TECHNIQUES].index(c[0]), c[1]))


def test_every_accepted_cell_has_a_test():
    assert set(COVERED) | set(RUN_HERE) == accepted()
    assert not set(COVERED) - accepted(), "a covered cell is no longer accepted: drop it from COVERED"
    for test in COVERED.values():
        path, name = test.split("::")
        assert re.search(rf"^def {re.escape(name.split('[')[0])}\(", (ROOT / path).read_text(), re.M), test


@pytest.fixture(scope="module")
def teacher(tiny_text, tmp_path_factory):
    from helpers import params_after

    run = tmp_path_factory.mktemp("teacher") / "run"
    params_after(tiny_gpt_config(tiny_text, "parallel.dp=1", "train.steps=3", "model.vocab_multiple=64",
                                 "checkpoint.every=0"), run)
    return run


@pytest.fixture(scope="module")
def one(tiny_text, tmp_path_factory):
    return one_process_runs(tiny_text, tmp_path_factory.mktemp("one"), *BASE)


@pytest.mark.parametrize("technique, layout", RUN_HERE, ids=[f"{t}@{lay}" for t, lay in RUN_HERE])
def test_accepted_cell_follows_one_process(request, tiny_text, tmp_path, teacher, one, technique, layout):
    keys = tuple(k.format(teacher=teacher) for k in dict(TECHNIQUES)[technique]) + EXTRA.get(technique, ())
    lay = dict(LAYOUTS)[layout]
    ref_keys = tuple(k for k in keys if not k.startswith("parallel.compression")) if technique in UNCOMPRESSED else keys
    # torchao's AdamW8bit compiles its step per parameter shape in every rank: the cells run it eagerly (eager())
    task = eager_rank0_params if technique == "adamw8bit" else rank0_params
    with eager() if technique == "adamw8bit" else contextlib.nullcontext():
        ref = one(*ref_keys, *(k for k in lay if k.startswith("model.")))  # ep2 brings its experts
    pool = request.getfixturevalue(f"pool{WORLD.get(layout, 2)}")
    got = pool.run(task, tiny_gpt_config(tiny_text, *BASE, *lay, *keys), tmp_path / "run")[0]
    if technique == "PowerSGD":
        losses = step_losses(tmp_path / "run")
        assert all(b == pytest.approx(a, rel=0.1) for (a, _), (b, _) in zip(ref[1], losses, strict=True))
        return
    rel, atol = TOL.get(technique, (1e-4, 1e-4))
    assert_follows(ref, got, tmp_path / "run", steps=3, rel=rel, atol=atol)


@pytest.mark.parametrize("keys, message", [
    (("parallel.dp=1", "parallel.cp=2", "distill.teacher='{teacher}'"),
     "distill.teacher with parallel.cp = 2: the teacher would read each rank's share of a sequence without the rest "
     "of it (context parallel splits every sequence, and the teacher has no ring attention); set parallel.cp=1 or "
     "distill.teacher=''"),
    (("parallel.dp=1", "parallel.cp=2", "model.moe_experts=4", "model.moe_capacity_factor=1.25"),
     "parallel.cp = 2 with model.moe_capacity_factor = 1.25: an expert's capacity is counted per sequence, which cp "
     "cuts between ranks; set moe_capacity_factor=0 (dropless) or parallel.cp=1"),
], ids=["distill-cp", "moe-capacity-cp"])
def test_the_cells_that_do_not_run_say_why(tiny_text, teacher, keys, message):
    from plait.errors import ConfigError
    from plait.train.job import check_job

    with pytest.raises(ConfigError) as e:
        check_job(tiny_gpt_config(tiny_text, *BASE, *(k.format(teacher=teacher) for k in keys)))
    assert str(e.value) == message


def test_fp16_loss_scaling_of_moe_blocks_in_pipeline_stages(pool2, tiny_text, tmp_path, one):
    """The MoE layers' injected load-balancing gradient is scaled as the loss is (the loss over the micro-batches times
    the loss scale), so a pipeline's fp16 MoE run follows one process's."""
    keys = ("precision.dtype='fp16'", "model.moe_experts=4", "model.moe_aux_weight=0.1")
    got = pool2.run(rank0_params, tiny_gpt_config(tiny_text, *BASE, "parallel.dp=1", "parallel.pp=2", *keys),
                    tmp_path / "run")[0]
    assert_follows(one(*keys), got, tmp_path / "run", steps=3, rel=1e-2, atol=1e-2)
