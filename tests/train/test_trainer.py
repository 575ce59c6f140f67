"""Exact resume (DESIGN.md "Contracts"), on 2 gloo ranks against a single process, and the training loop's own features.

Layout independence (dp, micro-batch size, activation checkpointing, ...) is tests/parallel/test_equivalence.py's,
with plain SGD.
"""

import json

import pytest
import torch

from helpers import max_diff, params_after, rank0_params, tiny_gpt_config
from plait.config import load_config
from plait.train.checkpoint import latest_checkpoint


def test_resume_continues_the_same_trajectory(pool2, tiny_text, tmp_path):
    straight = pool2.run(rank0_params, tiny_gpt_config(tiny_text, "train.steps=20"), tmp_path / "straight")[0]
    first = tiny_gpt_config(tiny_text, "train.steps=20", "train.stop_after=10")
    pool2.run(rank0_params, first, tmp_path / "split")
    assert latest_checkpoint(tmp_path / "split").name == "step_0000010"
    resumed = pool2.run(rank0_params, tiny_gpt_config(tiny_text, "train.steps=20"), tmp_path / "split", True)[0]
    assert max_diff(straight, resumed) <= 1e-6
    summary = json.loads((tmp_path / "split" / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["resumed_from_step"] == 10
    steps = [m["step"] for m in map(json.loads, (tmp_path / "split" / "metrics.jsonl").read_text().splitlines())
             if "loss" in m]
    assert steps == list(range(1, 21))  # one metrics line per step, across both sessions


def test_resume_with_another_micro_batch_and_world_size(pool2, tiny_text, tmp_path):
    straight = params_after(tiny_gpt_config(tiny_text, "parallel.dp=1", "train.steps=20"), tmp_path / "straight")
    first = tiny_gpt_config(tiny_text, "train.steps=20", "train.stop_after=10", "train.micro_batch_size=4")
    pool2.run(rank0_params, first, tmp_path / "run")
    # The second half runs in a single process with micro-batches of 2 (accumulation 4 instead of 1).
    second = tiny_gpt_config(tiny_text, "parallel.dp=1", "train.steps=20", "train.micro_batch_size=2")
    resumed = params_after(second, tmp_path / "run", resume=True)
    assert max_diff(straight, resumed) <= 1e-5


def test_bf16_autocast_trains_close_to_fp32(tiny_text, tmp_path):
    losses = {}
    for dtype in ("fp32", "bf16"):
        params_after(tiny_gpt_config(tiny_text, "parallel.dp=1", "train.steps=5", f"precision.dtype='{dtype}'"),
                     tmp_path / dtype)
        rows = map(json.loads, (tmp_path / dtype / "metrics.jsonl").read_text().splitlines())
        losses[dtype] = [m["loss"] for m in rows if "loss" in m]
    diffs = [abs(a - b) for a, b in zip(losses["bf16"], losses["fp32"], strict=True)]
    # bf16 keeps 8 bits of mantissa: a loss of ~4.8 is a mean over 8 x 32 tokens, which averages the roundings to a
    # few 1e-5 .. 2e-4 per step (measured: at most 1.7e-4); fp32 would give 0, fp16's 11 bits at most 1.5e-5
    assert len(diffs) == 5 and max(diffs) < 1e-3, losses
    assert max(diffs) > 5e-5, losses


def test_fp16_uses_a_loss_scaler_that_is_checkpointed(tiny_text, tmp_path):
    from plait.train.trainer import train  # as test_mlp_on_digits_learns: the live scaler is on train()'s result

    fp16 = ("parallel.dp=1", "train.steps=6", "precision.dtype='fp16'")
    straight = train(tiny_gpt_config(tiny_text, *fp16), tmp_path / "straight").strategy.precision.scaler
    first = train(tiny_gpt_config(tiny_text, *fp16, "train.stop_after=4"), tmp_path / "split").strategy.precision.scaler
    saved = json.loads((latest_checkpoint(tmp_path / "split") / "trainer_state.json").read_text())["precision"]
    # 4 steps without an overflow: the initial scale, grown after none of its 2000-step interval
    assert saved == first.state_dict() == {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                           "growth_interval": 2000, "_growth_tracker": 4}
    resumed = train(tiny_gpt_config(tiny_text, *fp16), tmp_path / "split", resume=True).strategy.precision.scaler
    # the resumed run continued counting from the saved tracker (a fresh scaler would stand at 2 after 2 steps)
    assert resumed.state_dict() == straight.state_dict() and resumed.state_dict()["_growth_tracker"] == 6


def test_mlp_on_digits_learns(tmp_path):
    from plait.train.trainer import train

    cfg = load_config(None, ["model.name='mlp'", "data.name='digits'", "model.width=64", "train.global_batch_size=64",
                             "train.micro_batch_size=16", "train.sample_tokens=0", "log.progress=false",
                             "log.report=false", "optim.lr=0.01", "train.eval_samples=400", "train.eval_batch_size=50",
                             "parallel.dp=1", "train.steps=150"])
    result = train(cfg, tmp_path / "dp1")
    assert result.summary["val_accuracy"] > 0.9  # 10 classes: chance is 0.1
    assert result.summary["final_loss"] < 0.3 * result.summary["initial_loss"]


def test_checkpoints_are_published_and_pruned(tiny_text, tmp_path):
    cfg = tiny_gpt_config(tiny_text, "parallel.dp=1", "train.steps=17", "checkpoint.every=4", "checkpoint.keep=2")
    params_after(cfg, tmp_path)
    root = tmp_path / "checkpoints"
    names = sorted(p.name for p in root.iterdir())
    assert names == ["latest", "step_0000016", "step_0000017"]  # the final step is always saved
    assert latest_checkpoint(tmp_path) == (root / "step_0000017").resolve()
    assert not any(p.name.startswith(".") for p in root.iterdir())


def test_lr_schedule_warmup_then_cosine():
    from plait.train.optim import lr_at

    cfg = load_config(None, ["optim.lr=1.0", "optim.warmup_steps=10", "optim.min_lr_ratio=0.1"]).optim
    assert lr_at(0, cfg, 110) == pytest.approx(0.1)
    assert lr_at(9, cfg, 110) == pytest.approx(1.0)
    assert lr_at(60, cfg, 110) == pytest.approx(0.55)  # half-way: floor + (1 - floor) / 2
    assert lr_at(110, cfg, 110) == pytest.approx(0.1)


def test_loss_is_a_global_batch_mean_whatever_the_split():
    """The per-micro-batch scaling: sum over micro-batches of mean * (len/local) == the batch mean."""
    from plait.train.loss import lm_loss

    torch.manual_seed(0)
    logits, y = torch.randn(8, 5, 7), torch.randint(0, 7, (8, 5))
    whole = lm_loss(logits, y)
    split = sum(lm_loss(logits[i:i + 2], y[i:i + 2]) * (2 / 8) for i in range(0, 8, 2))
    assert float(whole) == pytest.approx(float(split), abs=1e-6)


@pytest.mark.slow
def test_compile_keeps_the_trajectory(tiny_text):
    from helpers import reset_compiler

    reset_compiler()
    plain = params_after(tiny_gpt_config(tiny_text, "parallel.dp=1", "train.steps=3"), None)
    compiled = params_after(tiny_gpt_config(tiny_text, "parallel.dp=1", "train.steps=3", "train.compile=true"), None)
    assert max_diff(plain, compiled) <= 1e-4  # inductor fuses ops: float rounding differs, training does not


def test_periodic_evaluation_is_logged(tiny_text, tmp_path):
    params_after(tiny_gpt_config(tiny_text, "parallel.dp=1", "train.steps=10", "train.eval_every=4"), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    assert [s for s, _ in evals] == [4, 8, 10]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert evals[-1][1] == summary["val_loss"] and evals[0][1] > evals[-1][1]
