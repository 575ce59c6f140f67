"""`plait tune`: Optuna over real `plait train` runs. A learning-rate search on mlp/digits lands within a factor of
3 of the best of a grid measured here, pruning (ASHA, by preemption) cuts the steps run by >= 40 % against running
every trial to the end (counted), and a re-run continues the study."""

from __future__ import annotations

import csv
import json
import re

import pytest

from helpers import params_after, plait
from plait.config import load_config

pytest.importorskip("optuna", reason="plait tune needs Optuna (the dev extra installs it)")

BASE = ["model.name=mlp", "data.name=digits", "model.width=32", "parallel.dp=1", "train.steps=40",
        "train.global_batch_size=32", "train.micro_batch_size=32", "train.eval_samples=128", "log.every=4",
        "log.progress=false", "log.report=false", "optim.name=sgd", "optim.momentum=0", "optim.warmup_steps=0",
        "optim.schedule=constant", "checkpoint.every=0"]
GRID = [0.03, 0.1, 0.3, 1.0, 3.0]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    # One trial at a time: every trial's values, and so the sampler's and the pruner's decisions, are the same from
    # run to run (with trials in parallel, which finishes first would steer TPE).
    d = tmp_path_factory.mktemp("tune")
    (d / "space.toml").write_text("optim.lr = {log_uniform = [0.01, 3.0]}\n")
    args = ["tune", *[a for s in BASE for a in ("--set", s)], "--space", d / "space.toml", "--concurrency", "1",
            "--pruner", "asha", "--eval-every", "8", "--seed", "3", "--out", d / "study"]
    slow = "slow:seconds=0.04"  # every step >= 40 ms: a trial lasts long enough for its figures to be read in time
    first = plait(*args, "--trials", "4", timeout=600, faults=slow)
    assert first.returncode == 0, first.stdout + first.stderr
    again = plait(*args, "--trials", "6", timeout=600, faults=slow)  # the same command, a larger budget: continues
    assert again.returncode == 0, again.stdout + again.stderr
    return d / "study", first.stdout, again.stdout


@pytest.mark.slow
def test_the_search_finds_a_learning_rate_near_the_grids_best_and_pruning_saves_steps(study, tmp_path):
    out, first, again = study
    s = json.loads((out / "summary.json").read_text())
    assert s["trials"] == 6 and s["complete"] + s["pruned"] + s["failed"] == 6 and s["failed"] == 0
    assert "2 trials to run (4 of 6 done)" in again
    grid = {}
    for lr in GRID:
        run = tmp_path / f"lr{lr}"
        params_after(load_config(None, [*BASE, f"optim.lr={lr}", "train.eval_every=40"]), run)
        grid[lr] = json.loads((run / "summary.json").read_text())["val_loss"]
    best_lr = min(grid, key=grid.get)
    found = s["best_params"]["optim.lr"]
    assert best_lr / 3 <= found <= best_lr * 3, (found, grid)
    assert s["best_value"] <= min(grid.values()) * 1.5, (s["best_value"], grid)
    # pruning, counted: steps the trials ran against every trial run to its end
    assert s["pruned"] >= 1 and s["steps_run"] <= 0.6 * s["steps_without_pruning"], s
    rows = list(csv.DictReader((out / "trials.csv").open()))
    assert sum(int(r["steps"]) for r in rows) == s["steps_run"]
    assert {r["state"] for r in rows} <= {"complete", "pruned"}
    assert all(int(r["steps"]) < 40 for r in rows if r["state"] == "pruned")
    steps = {int(r["trial"]): int(r["steps"]) for r in rows}
    said = re.findall(r"trial (\d+): .* -> pruned at step (\d+)(?: \(its run stopped at step (\d+), the next "
                      r"checkpoint\))?\n", first + again)
    assert len(said) == s["pruned"] and all(steps[int(n)] == int(ran or at) for n, at, ran in said), said
    assert (out / "importance.png").is_file() == (s["complete"] >= 3)  # fANOVA over fewer finished trials is noise
    assert (out / "best" / "summary.json").is_file() and (out / "report.html").is_file()
    assert (out / "history.png").is_file() and 'src="history.png"' in (out / "report.html").read_text()


def test_a_bad_space_is_refused_naming_the_key(tmp_path):
    from plait.errors import ConfigError
    from plait.tune.space import read_space

    f = tmp_path / "space.toml"
    for text, message in [("optim.lrr = {log_uniform = [1e-4, 1e-2]}", "optim.lrr is not a config key; did you mean "
                                                                        "optim.lr?"),
                          ("optim.lr = {log_uniform = [0, 1e-2]}", "optim.lr: log_uniform needs low > 0"),
                          ("optim.lr = {normal = [0, 1]}", "optim.lr = {'normal': [0, 1]}: give one of log_uniform"),
                          ("model.width = {int = [64.5, 128]}", "model.width: int takes whole numbers")]:
        f.write_text(text + "\n")
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("{", r"\{").replace(
                "(", r"\(").replace(")", r"\)")):
            read_space(f)
    f.write_text("optim.lr = {log_uniform = [1e-4, 1e-2]}\nmodel.width = {choice = [16, 32]}\n")
    assert [(d.key, d.kind, d.values) for d in read_space(f)] == [("optim.lr", "log_uniform", (1e-4, 1e-2)),
                                                                  ("model.width", "choice", (16, 32))]


def test_a_damaged_shared_journal_is_one_line_not_a_traceback(tmp_path):
    """Issue 37 N14: a study whose journal holds a trial with a steps attribute plait tune never writes."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    out = tmp_path / "study"
    out.mkdir()
    storage = JournalStorage(JournalFileBackend(str(out / "study.journal")))
    study = optuna.create_study(study_name=out.name, storage=storage, direction="minimize")
    trial = study.ask({"optim.lr": optuna.distributions.FloatDistribution(0.01, 3.0, log=True)})
    trial.set_user_attr("steps", "many")
    trial.set_user_attr("run_dir", str(out / "trials" / "0000"))
    study.tell(trial, 1.0)
    (tmp_path / "space.toml").write_text("optim.lr = {log_uniform = [0.01, 3.0]}\n")
    r = plait("tune", *[a for s in BASE for a in ("--set", s)], "--space", tmp_path / "space.toml", "--trials", "1",
              "--out", out)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert ("trial 0 has steps = 'many', which plait tune does not write; the journal is damaged or another "
            "program's: start a new study") in r.stderr
