"""finetune.progressive_freeze: the schedule, frozen blocks fixed from their step on, dp=2 equal to one process."""

from __future__ import annotations

import json

import pytest
import torch
from ft_helpers import assert_same, gpt, run_trajectory

from plait.config import load_config
from plait.errors import ConfigError
from plait.finetune import freeze_steps
from plait.train.job import check_job

# Tiny GPT (2 blocks), 4 steps, t0 = 0.25 * 4 = 1: block 0 (with pos_emb) frozen after step 1, block 1 after step 2.
PROGRESSIVE = ("train.steps=4", "finetune.progressive_freeze=true", "finetune.progressive_freeze_start=0.25")


def test_the_schedule_is_floor_of_t0_plus_i_times_the_rest_over_the_blocks():
    assert freeze_steps(4, 100, 0.5) == [50, 62, 75, 87]
    assert freeze_steps(3, 10, 0.3) == [3, 5, 7]  # 3 + i 7/3, exact (0.3 is read as 3/10)
    assert freeze_steps(2, 4, 0.25) == [1, 2]
    assert freeze_steps(4, 8, 0.0) == [0, 2, 4, 6]


def test_layouts_that_cannot_change_what_trains_are_refused(tiny_text):
    with pytest.raises(ConfigError, match=r"progressive_freeze_start = 1.0 must be in \[0, 1\)"):
        check_job(load_config(None, gpt(tiny_text, *PROGRESSIVE[:2], "finetune.progressive_freeze_start=1.0")))
    with pytest.raises(ConfigError, match=r"model 'deepfm' has no `blocks`"):
        check_job(load_config(None, ["model.name='deepfm'", "data.name='clicks'", "finetune.progressive_freeze=true"]))


def _run(cfg, run_dir):
    """Pool task: the trajectory, plus rank 0's metrics.jsonl rows."""
    out = run_trajectory(cfg, run_dir)
    if out is None:
        return None
    return (*out, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])


@pytest.fixture(scope="module")
def runs(tiny_text, tmp_path_factory):
    """The 4-step run in one process, and the same run stopped after 1 and 2 steps (the weights at the freezes)."""
    root = tmp_path_factory.mktemp("progressive")
    return {n: _run(load_config(None, gpt(tiny_text, "parallel.dp=1", *PROGRESSIVE, f"train.stop_after={n}")), root / f"s{n}")
            for n in (1, 2, 4)}


def _block(params: dict, prefixes: tuple[str, ...]) -> list[str]:
    return [k for k in params if k.startswith(prefixes)]


def test_frozen_blocks_keep_their_weights_from_their_step_while_the_rest_trains(runs):
    after1, after2, final = runs[1][2], runs[2][2], runs[4][2]
    front = _block(final, ("pos_emb.", "blocks.0."))
    block1 = _block(final, ("blocks.1.",))
    rest = _block(final, ("tok_emb.", "ln_f.", "head."))  # the tied token embedding trains through the head
    assert front and block1 and rest
    assert all(torch.equal(final[k], after1[k]) for k in front)
    assert all(torch.equal(final[k], after2[k]) for k in block1)
    assert not any(torch.equal(after2[k], after1[k]) for k in block1 if k.endswith("weight"))  # moved at step 2
    assert not any(torch.equal(final[k], after2[k]) for k in rest if k.endswith("weight"))
    rows = runs[4][4]
    assert [r["frozen_blocks"] for r in rows if "loss" in r] == [0, 1, 2, 2]
    assert [(r["step"], r["froze"]) for r in rows if "froze" in r] == [(1, "blocks.0"), (2, "blocks.1")]
    n = {k: v.numel() for k, v in final.items()}
    assert runs[4][3]["trainable_params"] == sum(n[k] for k in ("tok_emb.weight", "ln_f.weight", "ln_f.bias"))


def test_dp2_follows_the_single_process_trajectory_and_sends_only_what_trains(pool2, runs, tiny_text, tmp_path):
    got = pool2.run(_run, load_config(None, gpt(tiny_text, "parallel.dp=2", *PROGRESSIVE)), tmp_path)[0]
    assert_same(runs[4][:4], got[:4])
    params = got[2]
    n = lambda prefixes: sum(params[k].numel() for k in _block(params, prefixes))  # noqa: E731
    trainable = [n(("tok_emb.", "ln_f.", "pos_emb.", "blocks.")), n(("tok_emb.", "ln_f.", "blocks.1.")),
                 n(("tok_emb.", "ln_f."))]
    sent = [r["comm_bytes"] for r in got[4] if "loss" in r]
    # DDP at dp=2 sends 4 bytes per trainable element, rebuilt at each freeze; + the 24-byte gather of the logged loss.
    assert sent[1:] == [4 * trainable[1] + 24, 4 * trainable[2] + 24, 4 * trainable[2] + 24]
    assert sent[0] == 4 * trainable[0]


@pytest.mark.parametrize("zero, layout", [(1, "parallel.dp=2"), (2, "parallel.dp=2"), (3, "parallel.dp=2"),
                                          (3, "parallel.cp=2"), (0, "parallel.tp=2")],
                         ids=["zero1", "zero2", "zero3", "cp2-zero3", "tp2"])
def test_zero_2_and_3_follow_it_too_and_stop_reduce_scattering_what_froze(pool2, runs, tiny_text, tmp_path, zero,
                                                                         layout):
    """FSDP2's unsharded copies stop requiring a gradient with their parameters: a frozen block's gradients are
    neither computed nor reduce-scattered (2 bytes per element less at dp = 2, fp32), its weights fixed; at ZeRO-3
    its backward, and so the all-gather before it, does not run either (2 bytes more)."""
    dp = "parallel.dp=2" if layout == "parallel.dp=2" else "parallel.dp=1"
    more = ("model.vocab_multiple=64",) if "tp" in layout else ()  # the vocabulary splits over tp
    got = pool2.run(_run, load_config(None, gpt(tiny_text, dp, layout, f"parallel.zero={zero}", *PROGRESSIVE, *more)),
                    tmp_path)[0]
    if more:  # another vocabulary padding: its own one-process run
        assert_same(_run(load_config(None, gpt(tiny_text, "parallel.dp=1", *PROGRESSIVE, *more)), tmp_path / "one")[:4],
                    got[:4])
        return
    assert_same(runs[4][:4], got[:4])
    if "cp" in layout:  # its bytes are ring attention's too
        return
    params = got[2]
    block1 = sum(params[k].numel() for k in _block(params, ("blocks.1.",)))
    sent = [r["comm_bytes"] for r in got[4] if "loss" in r]
    # ZeRO-1's flat buffers are laid out once: the same bytes whatever froze
    assert sent[1] - sent[2] == {1: 0, 2: 2, 3: 4}[zero] * block1 and sent[2] == sent[3]


def test_the_report_plots_step_time_with_the_freezes_marked(runs, tmp_path):
    from plait.report.plots import freeze_points

    rows = runs[4][4]
    assert freeze_points(rows, tmp_path / "freeze.png") == tmp_path / "freeze.png"
    assert (tmp_path / "freeze.png").stat().st_size > 1000
    assert freeze_points([r for r in rows if "froze" not in r], tmp_path / "none.png") is None  # no freezes, no plot


def test_a_resumed_run_freezes_what_its_checkpoint_had_frozen_and_continues_exactly(tiny_text, tmp_path):
    """AdamW (optimizer state exists): stopped after step 2 (block 0 frozen, its state dropped), resumed to step 4."""
    from plait.train.trainer import train

    adamw = (*PROGRESSIVE, "parallel.dp=1", "optim.name='adamw'", "optim.lr=3e-3")
    whole = run_trajectory(load_config(None, gpt(tiny_text, *adamw)), tmp_path / "whole")
    train(load_config(None, gpt(tiny_text, *adamw, "train.stop_after=2")), tmp_path / "split")
    resumed = train(load_config(None, gpt(tiny_text, *adamw)), tmp_path / "split", resume=True)
    got = resumed.strategy.full_model_state_dict()
    assert all(torch.equal(got[k], whole[2][k]) for k in got)
    rows = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["froze"]) for r in rows if "froze" in r] == [(1, "blocks.0"), (2, "blocks.1")]
    assert [r["frozen_blocks"] for r in rows if "loss" in r] == [0, 1, 2, 2]


@pytest.mark.parametrize("layout", [("parallel.dp=1", "parallel.pp=2"),
                                    ("parallel.dp=2", "parallel.pp=2", "parallel.zero=3", "parallel.microbatches=2"),
                                    ("parallel.dp=1", "parallel.pp=2", "parallel.tp=2", "model.vocab_multiple=64")],
                         ids=["pp2", "dp2xpp2-zero3", "pp2xtp2"])
def test_pipeline_stages_freeze_the_blocks_they_hold_on_the_whole_models_schedule(pool2, pool4, runs, tiny_text,
                                                                                 tmp_path, layout):
    """Stage 0 holds block 0 (frozen after step 1, with pos_emb), stage 1 block 1 (after step 2): each rank freezes
    what it holds when the whole model's schedule says, and the run is the one process's."""
    pool = pool4 if "parallel.dp=2" in layout or "parallel.tp=2" in layout else pool2
    got = pool.run(_run, load_config(None, gpt(tiny_text, *layout, *PROGRESSIVE)), tmp_path)[0]
    ref = runs[4] if "parallel.tp=2" not in layout else \
        _run(load_config(None, gpt(tiny_text, "parallel.dp=1", *PROGRESSIVE, layout[-1])), tmp_path / "one")
    assert_same(ref[:4], got[:4])
    assert [(r["step"], r["froze"]) for r in got[4] if "froze" in r] == [(1, "blocks.0"), (2, "blocks.1")]
