"""Warm trials (plait.tune.warm): a one-process trial forked from a warm interpreter runs what `plait train` runs.
The same 2-trial study with --no-warm (every trial a `plait train` process) draws the same values and its trials log the same
losses step for step, with the same run-dir files; a trial whose values plait train refuses fails with the same line;
a layout of two processes is not forked."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from helpers import ENV, step_losses
from plait.config import load_config
from plait.tune.warm import applies

pytest.importorskip("optuna", reason="plait tune needs Optuna (the dev extra installs it)")

SETS = ["model.name=gpt", "data.name=stdlib-text", "model.width=16", "model.depth=1", "model.heads=4",
        "model.context=16", "parallel.dp=1", "train.steps=6", "train.global_batch_size=4", "train.micro_batch_size=4",
        "train.eval_samples=8", "train.sample_tokens=0", "log.every=1", "log.report=false", "optim.name=sgd",
        "optim.momentum=0", "optim.warmup_steps=0", "checkpoint.every=0"]


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    d = tmp_path_factory.mktemp("warm")
    # the second trial's width (18) is not a multiple of the 4 heads: plait train refuses it
    (d / "space.toml").write_text("optim.lr = {log_uniform = [0.01, 0.3]}\nmodel.width = {choice = [16, 18]}\n")
    jobs = {}
    for name, extra in (("cold", ["--no-warm"]), ("warm", [])):  # side by side: the studies mostly wait on trials
        cmd = [sys.executable, "-m", "plait", "tune", *[a for s in SETS for a in ("--set", s)], "--space",
               str(d / "space.toml"), "--trials", "2", "--pruner", "none", "--seed", "5", "--out", str(d / name), *extra]
        jobs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    out = {}
    for name, job in jobs.items():
        said = job.communicate(timeout=300)[0]
        assert job.returncode == 0, said
        out[name] = (d / name, said)
    return out


def _trials(study):
    return {int(r["trial"]): r for r in csv.DictReader((study / "trials.csv").open())}


def test_warm_trials_follow_plait_train_step_for_step(studies):
    (warm, said), (cold, _) = studies["warm"], studies["cold"]
    a, b = _trials(warm), _trials(cold)
    assert {k: (r["state"], r["optim.lr"], r["model.width"]) for k, r in a.items()} == \
        {k: (r["state"], r["optim.lr"], r["model.width"]) for k, r in b.items()}
    complete = [k for k, r in a.items() if r["state"] == "complete"]
    assert complete and len(complete) < len(a), a  # both kinds of trial were drawn (seed 5: width 16, then 18)
    for k in complete:
        run_w, run_c = (s / "trials" / f"{k:04d}" for s in (warm, cold))
        losses = step_losses(run_w)
        assert len(losses) == 6 and losses == step_losses(run_c)
        assert (run_w / "config.toml").read_text() == (run_c / "config.toml").read_text()
        sw, sc = (json.loads((r / "summary.json").read_text()) for r in (run_w, run_c))
        assert sw["val_loss"] == sc["val_loss"] and sw["steps"] == sc["steps"] == 6
        assert {p.name for p in run_w.iterdir()} == {p.name for p in run_c.iterdir()} - {"logs"}  # torchrun's logs
        assert "done: 6 steps" in (warm / "logs" / f"{k:04d}.log").read_text()
        assert a[k]["value"] == b[k]["value"] and f"trial {k}: " in said


def test_a_refused_trial_fails_with_plait_trains_line(studies):
    (warm, said), (cold, _) = studies["warm"], studies["cold"]
    failed = [k for k, r in _trials(warm).items() if r["state"] == "fail"]
    assert failed
    for k in failed:
        line = "error: model.width (18) must be divisible by model.heads (4); change one of them (e.g. width=16)"
        for study in (warm, cold):
            assert (study / "logs" / f"{k:04d}.log").read_text().strip().splitlines()[-1] == line
        assert _trials(warm)[k]["error"] == _trials(cold)[k]["error"] == line
        assert f"-> failed (exit code 2): {line}" in said


def test_only_a_one_process_job_runs_warm():
    assert applies(load_config(None, SETS))
    assert not applies(load_config(None, [*SETS, "parallel.dp=2", "train.micro_batch_size=2"]))
    assert not applies(load_config(None, [*SETS, "launch.launcher=ray"]))
