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


def _keep_best_job(*sets: str):
    # SGD at a learning rate high enough that validation loss goes down and up: best at step 6, worse at 8 and 12
    return load_config(None, ["model.name=mlp", "data.name=digits", "parallel.dp=1", "model.width=16", "model.depth=1",
                              "train.global_batch_size=16", "train.micro_batch_size=16", "train.steps=16",
                              "train.eval_every=2", "train.eval_samples=64", "checkpoint.every=2", "optim.lr=2.0",
                              "optim.name=sgd", "optim.momentum=0", "optim.warmup_steps=0", "optim.schedule=constant",
                              "log.progress=false", "log.report=false", "checkpoint.keep_best='val_loss'",
                              "train.early_stop={patience=3}", *sets])


def _evaluations(run) -> list[tuple[int, float]]:
    return [(m["step"], m["val_loss"]) for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "val_loss" in m]


def test_a_resumed_run_keeps_its_best_checkpoint_and_its_patience(tmp_path):
    """keep_best and early_stop are callbacks whose state is in the checkpoint: a run stopped after step 6 and resumed
    decides as the uninterrupted one (best stays at step 6, patience runs out at step 12); without that state the
    first evaluation after the resume (step 8, worse) would re-point checkpoints/best and patience would restart."""
    from plait.train.trainer import train

    whole, split = tmp_path / "whole", tmp_path / "split"
    ref = train(_keep_best_job(), whole).summary
    first = train(_keep_best_job("train.stop_after=6"), split).summary
    state = json.loads((split / "checkpoints" / "step_0000006" / "trainer_state.json").read_text())["callbacks"]
    assert state["early_stop"]["waited"] == 0 and state["keep_best"]["step"] == 6 == first["best"]["step"]
    assert os.readlink(split / "checkpoints" / "best") == "step_0000006"
    resumed = train(_keep_best_job(), split, resume=True).summary
    vals = _evaluations(whole)
    assert [s for s, _ in vals] == [2, 4, 6, 8, 10, 12]
    best_step = min(vals, key=lambda sv: sv[1])[0]
    assert best_step == 6 and vals[3][1] > vals[2][1]  # step 8's evaluation is worse than step 6's
    assert _evaluations(split) == vals  # the same evaluations, each once, across the two sessions
    assert ref["early_stop"] == resumed["early_stop"] == {"step": 12, "metric": "val_loss", "best_step": 6,
                                                          "best_value": vals[2][1], "patience": 3}
    assert ref["best"] == resumed["best"] == {"metric": "val_loss", "step": 6, "value": vals[2][1]}
    assert os.readlink(whole / "checkpoints" / "best") == os.readlink(split / "checkpoints" / "best") == "step_0000006"
    assert resumed["steps"] == ref["steps"] == 12


def test_features_are_registered_in_the_order_their_callbacks_run():
    """Issue 56 item 5: the trainer's features are a list, as the schemes are; build.py only walks it."""
    from plait.train.features import FEATURES

    names = [f.name for f in FEATURES]
    assert names[0] == "learning rate" and names.index("slow device") < names.index("schemes")
    assert names.index("schemes") < names.index("keep best") < names.index("early stop") < names.index("time to target")
    assert len(set(names)) == len(names)
