"""Resuming: shape-changing overrides refused, --resume A --out B forks, metrics hold each step once, paths absolute."""

import json
import os
from pathlib import Path

import pytest
from launch_helpers import cli

from helpers import plait
from plait.train.metrics import MetricsWriter


def _snapshot(run: Path) -> dict:
    return {str(p.relative_to(run)): p.stat().st_mtime_ns for p in sorted(run.rglob("*")) if p.is_file()}


def test_an_override_that_changes_the_models_shapes_is_refused(straight_run):
    before = (straight_run / "config.toml").read_text()
    code, out, err = cli("train", "--resume", straight_run, "--set", "model.layers=1")
    assert code == 2
    assert (f"--resume {straight_run} --set model.layers=1: the run was saved with model.layers = 2 and its "
            "checkpoint holds that model") in err, err
    assert "train.init_from" in err
    assert (straight_run / "config.toml").read_text() == before


@pytest.mark.slow
def test_resume_with_out_forks_the_run_and_leaves_it_as_it_was(straight_run, tmp_path):
    src_files = _snapshot(straight_run)
    fork = tmp_path / "fork"
    r = plait("train", "--resume", straight_run, "--out", fork, "--set", "train.steps=12")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"forked {straight_run} at step_0000010 into {fork}" in r.stdout
    assert "resuming from" in r.stdout + r.stderr
    assert _snapshot(straight_run) == src_files  # the source run is untouched
    assert os.readlink(fork / "checkpoints" / "latest") == "step_0000012"
    steps = [m["step"] for m in map(json.loads, (fork / "metrics.jsonl").read_text().splitlines())
             if "loss" in m and "step" in m]
    assert steps == list(range(1, 13))
    code, out, err = cli("train", "--resume", straight_run, "--out", fork)
    assert code == 2 and "forking needs a new or empty --out folder" in err, err


def test_a_resumed_run_drops_the_metrics_of_the_steps_it_replays(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"event": "session", "restart_count": 0}] + [{"step": s, "loss": 1.0 / s} for s in range(1, 6)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 6, "lo')  # a killed writer's torn line
    w = MetricsWriter(path, keep_through=3)
    w.write({"event": "session", "restart_count": 1})
    w.write({"step": 4, "loss": 0.2})
    w.close()
    got = [json.loads(x) for x in path.read_text().splitlines()]
    assert got == lines[:4] + [{"event": "session", "restart_count": 1}, {"step": 4, "loss": 0.2}]


def test_a_new_run_stores_its_paths_absolute(job, tiny_text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rel = os.path.relpath(tiny_text, tmp_path)
    code, out, err = cli("train", job, "--set", f"data.path='{rel}'", "--out", "run", "--dry-run")
    assert code == 0, err
    saved = (tmp_path / "run" / "config.toml").read_text()
    assert f"path = \"{Path(tiny_text).resolve()}\"" in saved, saved


def test_an_export_gets_the_mode_of_any_new_file(straight_run, tmp_path):
    mask = os.umask(0)
    os.umask(mask)
    code, out, err = cli("export", straight_run, "-o", tmp_path / "m.safetensors")
    assert code == 0, err
    assert (tmp_path / "m.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
