"""Early stopping and keep_best: the decisions as data, the config's errors, and a dp=2 run that stops and keeps."""

import json
import os

import pytest

from helpers import rank0_params, tiny_gpt_config
from plait.config import load_config
from plait.errors import ConfigError
from plait.train.callbacks import Best, EarlyStop
from plait.train.job import check_job


def test_early_stop_waits_patience_evaluations_without_improvement():
    stop = EarlyStop("val_loss", patience=3, min_delta=0.05)
    decisions = [stop.update(s, {"val_loss": v}) for s, v in [(1, 3.0), (2, 2.5), (3, 2.47), (4, 2.6), (5, 2.46)]]
    assert decisions == [False, False, False, False, True]  # 2.47 and 2.46 are within min_delta of 2.5
    assert (stop.best.step, stop.best.value) == (2, 2.5)


def test_accuracy_is_better_when_higher():
    best = Best("val_accuracy")
    assert [best.update(s, {"val_accuracy": a}) for s, a in [(1, 0.5), (2, 0.4), (3, 0.7)]] == [True, False, True]
    assert best.step == 3


@pytest.mark.parametrize("sets, message", [
    (["train.eval_every=0", "train.early_stop={patience=2}"], "train.early_stop decides at evaluations: set train.eval_every"),
    (["train.eval_every=5", "train.early_stop={patience=0}"], "train.early_stop.patience = 0 must be an integer >= 1"),
    (["train.eval_every=5", "train.early_stop={patients=2}"], "train.early_stop has unknown keys ['patients']"),
    (["train.eval_every=5", "train.early_stop={metric='loss'}"], "train.early_stop.metric = 'loss': choose one of"),
    (["train.eval_every=5", "checkpoint.keep_best='val_los'"], "checkpoint.keep_best = 'val_los': choose one of"),
])
def test_bad_settings_are_named(sets, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_job(load_config(None, sets))


def test_a_run_stops_early_and_keeps_its_best_checkpoint(pool2, tiny_text, tmp_path):
    # min_delta 100: nothing after the first evaluation counts as better, so it stops at the third (step 6)
    cfg = tiny_gpt_config(tiny_text, "train.steps=20", "train.eval_every=2", "log.every=1", "checkpoint.every=0",
                          "checkpoint.keep=1", "train.early_stop={patience=2, min_delta=100.0}",
                          "checkpoint.keep_best='val_loss'")
    pool2.run(rank0_params, cfg, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 6
    assert summary["early_stop"] == {"step": 6, "metric": "val_loss", "best_step": 2,
                                     "best_value": summary["early_stop"]["best_value"], "patience": 2}
    vals = [(m["step"], m["val_loss"]) for m in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
            if "val_loss" in m]
    best_step = min(vals, key=lambda sv: sv[1])[0]
    assert summary["best"]["step"] == best_step and summary["best"]["metric"] == "val_loss"
    root = tmp_path / "checkpoints"
    assert os.readlink(root / "latest") == "step_0000006"
    assert os.readlink(root / "best") == f"step_{best_step:07d}" and (root / f"step_{best_step:07d}").is_dir()
    kept = sorted(p.name for p in root.glob("step_*"))
    assert kept == sorted({"step_0000006", f"step_{best_step:07d}"})  # keep = 1, plus the best
    from safetensors import safe_open

    from plait.cli import main

    assert main(["export", str(tmp_path), "--best", "-o", str(tmp_path / "best.safetensors")]) == 0
    with safe_open(str(tmp_path / "best.safetensors"), framework="pt") as f:
        assert f.metadata()["plait.checkpoint"] == f"step_{best_step:07d}"
