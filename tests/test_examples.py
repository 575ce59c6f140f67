"""Every shipped example config is valid, with the process count it is written for; the 3-D one runs end to end."""

import json
import math
from pathlib import Path

import pytest

from helpers import plait
from plait.cli import main
from plait.config import load_config
from plait.parallel.layout import Layout
from plait.train.job import load_job
from plait.train.trainer import train

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.toml"))
# what each example is written for (its header comment says so): a new example gets its line here
PROCESSES = {"cnn-digits.toml": 1, "deepfm-mp.toml": 2, "gpt-3d.toml": 8, "gpt-ddp.toml": 2, "gpt-pp.toml": 2,
             "gpt-tp.toml": 2, "mlp-digits.toml": 2}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_is_valid(path, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", str(path), "--dry-run", "--out", str(run)]) == 0
    assert f"config valid; {PROCESSES[path.name]} process(es); wrote {run / 'config.toml'}" in capsys.readouterr().out
    assert Layout.from_config(load_job(path)).world_size == PROCESSES[path.name]


def test_there_are_examples():
    assert [p.name for p in EXAMPLES] == sorted(PROCESSES)


# The 3-D example, shrunk to seconds of training: the default GPT at width 32 with 1 block per stage, 2 steps of
# 2 micro-batches per pipeline at a learning rate that moves step 2 (a gradient averaged wrongly shows in its loss), no
# evaluation. 8 gloo processes: what it costs is their start-up.
SHRINK = ["model.layers=2", "model.width=32", "model.heads=2", "model.context=32", "train.steps=2",
          "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_every=0", "train.eval_samples=0",
          "train.sample_tokens=0", "optim.warmup_steps=0", "optim.lr=1e-2", "log.every=1", "log.progress=false",
          "log.report=false", "checkpoint.every=0"]


def losses(run: Path) -> list[float]:
    return [m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


@pytest.mark.slow
def test_the_3d_example_trains_on_8_processes_as_one_process_does(tmp_path):
    path = Path(__file__).parent.parent / "examples" / "gpt-3d.toml"
    run = tmp_path / "3d"
    r = plait("train", path, "--out", run, *(a for o in SHRINK for a in ("--set", o)), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "8 processes (dp=2 tp=2 pp=2, pipeline-1f1b)" in r.stdout, r.stdout
    s = json.loads((run / "summary.json").read_text())
    assert (s["world_size"], s["steps"], s["grad_accum"]) == (8, 2, 2)
    assert s["parallel"] == {"dp": 2, "tp": 2, "pp": 2, "cp": 1, "strategy": "pipeline-1f1b"}
    assert (s["pipeline"]["stages"], s["pipeline"]["microbatches"], s["pipeline"]["schedule"]) == (2, 2, "1f1b")
    assert len(s["memory"]["per_rank"]) == 8
    # the same job in one process: the 3-D layout reproduces its losses (README: within 1e-4 for the mixes)
    one = load_config(path, [*SHRINK, "parallel.dp=1", "parallel.tp=1", "parallel.pp=1"])
    train(one, tmp_path / "one")
    three_d = losses(run)
    assert len(three_d) == 2 and all(math.isfinite(x) for x in three_d), three_d
    assert three_d == pytest.approx(losses(tmp_path / "one"), abs=1e-4)
