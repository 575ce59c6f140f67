"""`plait tune --objectives`: a multi-objective (architecture) search; the Pareto front against the trials' own
figures, the median pruning rule on the first objective, and bad objectives named."""

from __future__ import annotations

import csv
import json

import pytest

from helpers import plait
from plait.errors import ConfigError
from plait.tune.pareto import dominates, front, parse_objectives, worse_than_median

pytest.importorskip("optuna", reason="plait tune needs Optuna (the dev extra installs it)")


def test_the_front_is_what_nothing_dominates():
    points = {0: [1.0, 10.0], 1: [2.0, 5.0], 2: [2.5, 5.0], 3: [0.5, 20.0], 4: [3.0, 1.0]}
    assert front(points, ["minimize", "minimize"]) == [0, 1, 3, 4]  # 2 is beaten by 1 on the first, tied on the second
    assert dominates([2.0, 5.0], [2.5, 5.0], ["minimize", "minimize"])
    assert front({0: [0.9, 10.0], 1: [0.8, 5.0]}, ["maximize", "minimize"]) == [0, 1]
    assert worse_than_median(3.0, [1.0, 2.0, 4.0], "minimize") and not worse_than_median(3.0, [1.0], "minimize")
    assert worse_than_median(0.5, [0.6, 0.9], "maximize")


@pytest.mark.parametrize("text, message", [
    ("val_loss:minimize", "--objectives 'val_loss:minimize' names 1 objective; give two or more (one: --metric)"),
    ("val_loss:min,params:minimize", "--objectives 'val_loss:min,params:minimize': write NAME:minimize or "
                                     "NAME:maximize, comma-separated, e.g. val_loss:minimize,params:minimize"),
    ("params:minimize,val_loss:minimize", "--objectives: the first objective (params) is the one trials are pruned on "
                                          "and must be a validation figure (val_loss, val_accuracy, ...)"),
])
def test_bad_objectives_are_named(text, message):
    with pytest.raises(ConfigError) as e:
        parse_objectives(text)
    assert str(e.value) == message


def test_an_architecture_search_prints_and_keeps_its_pareto_front(tmp_path):
    (tmp_path / "space.toml").write_text("model.width = {choice = [4, 64]}\nmodel.depth = {int = [1, 2]}\n")
    sets = ["model.name=mlp", "data.name=digits", "parallel.dp=1", "train.steps=20", "train.global_batch_size=32",
            "train.micro_batch_size=32", "train.eval_samples=128", "log.report=false", "checkpoint.every=0"]
    r = plait("tune", *[a for s in sets for a in ("--set", s)], "--space", tmp_path / "space.toml", "--trials", "2",
              "--objectives", "val_loss:minimize,params:minimize", "--pruner", "none", "--out", tmp_path / "study")
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads((tmp_path / "study" / "summary.json").read_text())
    rows = list(csv.DictReader((tmp_path / "study" / "trials.csv").open()))
    figures = {int(row["trial"]): [float(v) for v in row["value"].split()] for row in rows if row["state"] == "complete"}
    assert len(figures) == 2 and s["objectives"] == {"val_loss": "minimize", "params": "minimize"}
    assert [p["trial"] for p in s["pareto"]] == front(figures, ["minimize", "minimize"])
    for p in s["pareto"]:  # each is its run's own figures
        run = json.loads((tmp_path / "study" / "trials" / f"{p['trial']:04d}" / "summary.json").read_text())
        assert p["values"] == [run["val_loss"], run["params"]]
    assert "the Pareto front (" in r.stdout and (tmp_path / "study" / "pareto.png").is_file()
