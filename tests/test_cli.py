"""The command line end to end: errors before any worker starts, the launcher, resume, export, torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import TINY_GPT

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}


def plait(*args: str, cwd: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plait", *map(str, args)], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=timeout)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "parallel.dp=3"], "train.global_batch_size (32) must be divisible by train.micro_batch_size (16) "
                                     "* parallel.dp (3) = 48"),
        (["--set", "launch.nproc_per_node=4"], "dp(2) * tp(1) * pp(1) = 2 processes but the launch gives "
                                               "nproc_per_node(4) * nnodes(1) = 4"),
        (["--set", "train.stepz=3"], "unknown key 'train.stepz'"),
        (["--set", "train.steps=many"], "train.steps = 'many' has the wrong type: it must be an integer"),
        (["--set", "optim.name=lion"], "optim.name = 'lion' is not one of: adamw, sgd, lamb, lars"),
        (["--set", "model.heads=3"], "model.width (128) must be divisible by model.heads (3)"),
        (["nothere.toml"], "config file 'nothere.toml' does not exist"),
    ],
)
def test_bad_config_exits_2_before_any_worker_starts(tmp_path, monkeypatch, capsys, args, message):
    # In-process (the same main() the console script runs); the process boundary is checked once below.
    from plait.cli import main

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    assert main(["train", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2
    assert not out.exists()  # nothing was started or written


def test_a_bad_config_exits_2_as_a_process(tmp_path):
    r = plait("train", "--set", "parallel.dp=3", "--out", tmp_path / "run", cwd=tmp_path, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith("error: train.global_batch_size (32) must be divisible")
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 2
    assert not (tmp_path / "run").exists()


def test_config_show_prints_every_key_with_its_doc(tmp_path):
    from plait.config import SECTIONS, toml_key

    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nsteps = 7\n[parallel]\ndp = 1\n")
    r = plait("config", "show", cfg, "--set", "optim.lr=0.5", timeout=60)
    assert r.returncode == 0, r.stderr
    import dataclasses

    for section, section_type in SECTIONS.items():
        assert f"[{section}]" in r.stdout
        for f in dataclasses.fields(section_type):
            assert any(line.startswith(f"{toml_key(f.name)} = ") and f.metadata["doc"] in line for line in r.stdout.splitlines())
    assert "steps = 7 " in r.stdout and "lr = 0.5 " in r.stdout and "dp = 1 " in r.stdout


# For the runs that check neither the report nor the sample: matplotlib's figures cost a second or so a run.
QUICK = ("--set", "log.report=false", "--set", "train.sample_tokens=0")


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory, tiny_text) -> Path:
    """A TOML file for a tiny GPT on the tiny corpus."""
    from plait.config import dump_config, load_config

    cfg = load_config(None, TINY_GPT + ["data.name='text'", f"data.path='{tiny_text}'", "log.every=2",
                                        "log.report=true", "train.sample_tokens=20", "optim.schedule='constant'"])
    path = tmp_path_factory.mktemp("cfg") / "tiny.toml"
    path.write_text(dump_config(cfg))
    return path


@pytest.mark.slow
def test_train_resume_export_through_the_launcher(tiny_config, tmp_path):
    run = tmp_path / "run"
    # 1. two workers through torchrun's agent
    r = plait("train", tiny_config, "--set", "train.steps=6", "--out", run)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 processes (dp=2, DDP)" in r.stdout and "unigram baseline" in r.stdout
    for name in ("config.toml", "metrics.jsonl", "summary.json", "report.html", "loss.png", "step_time.png",
                 "tokenizer.json", "spec.json"):
        assert (run / name).is_file(), name
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 4, 6]
    for m in steps:
        assert {"step", "loss", "lr", "tokens_per_s", "step_time_s", "time"} <= m.keys()
        assert {"data", "forward_backward", "optimizer"} <= m["time"].keys()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["world_size"] == 2 and summary["parallel"]["dp"] == 2
    assert {"initial_loss", "final_loss", "val_loss", "wall_time_s", "tokens_per_s", "unigram_val_loss"} <= summary.keys()
    assert os.readlink(run / "checkpoints" / "latest") == "step_0000006"

    # 2. a second session continues in place: more steps, and another layout (1 process)
    r = plait("train", "--resume", run, "--set", "train.steps=10", "--set", "parallel.dp=1", "--set", "log.report=false")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resuming from" in r.stdout and "step 6" in r.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["resumed_from_step"] == 6 and summary["world_size"] == 1
    assert "dp = 1" in (run / "config.toml").read_text()

    # 3. export: plain names, and the weights reproduce the run's validation loss in a fresh process. The export runs
    # in-process (the CLI's main(); `plait export` as a process: the README's Training block in tests/test_docs_run.py
    # and tests/plan/test_auto_layout.py), saving a subprocess's ~3 s of torch import.
    from plait.cli import main

    out = tmp_path / "model.safetensors"
    assert main(["export", str(run), "-o", str(out)]) == 0 and out.is_file()
    from safetensors import safe_open

    from plait.data import build_data
    from plait.data.datasets import eval_batches
    from plait.export import load_exported, rebuild_model
    from plait.train.loss import lm_loss

    model, meta = load_exported(out)
    cfg, _, plain = rebuild_model(run)
    with safe_open(str(out), framework="pt") as f:
        assert sorted(f.keys()) == sorted(plain.state_dict().keys())
        assert json.loads(meta["plait.model"])["width"] == cfg.model.width
    val = build_data(cfg.data, cfg.model).val
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers ran with one thread each
    try:
        with torch.no_grad():
            batches = eval_batches(val, cfg.train.eval_samples, cfg.train.eval_batch_size)
            losses = [float(lm_loss(model(val.fetch(b)[0]), val.fetch(b)[1]).double()) * len(b) for b in batches]
    finally:
        torch.set_num_threads(threads)
    assert sum(losses) / sum(len(b) for b in batches) == summary["val_loss"]


@pytest.mark.slow
def test_same_command_under_plain_torchrun(tiny_config, tmp_path):
    run = tmp_path / "tr"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "plait", "train", str(tiny_config), "--set", "train.steps=3", *QUICK, "--out", str(run)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3


@pytest.mark.slow
def test_error_inside_a_worker_is_one_line_and_exit_2(tiny_config, tmp_path):
    r = plait("train", tiny_config, "--set", "data.path='/no/such/corpus'", "--out", tmp_path / "x")
    assert r.returncode == 2
    assert "error: data.path = '/no/such/corpus' does not exist" in r.stderr
    assert "Traceback" not in r.stderr


def test_out_dir_of_an_existing_run_is_refused(tmp_path, capsys):
    # In-process (the process boundary is checked by test_a_bad_config_exits_2_as_a_process): a subprocess spends
    # ~5 s importing torch before it refuses.
    from plait.cli import main

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert main(["train", "--out", str(tmp_path / "run")]) == 2
    assert f"continue it with --resume {tmp_path / 'run'}" in capsys.readouterr().err


def _free_port() -> int:
    from helpers import free_port

    return free_port()


@pytest.mark.slow
def test_two_nodes_on_one_machine_form_one_job(tiny_config, tmp_path):
    """The same command on two 'machines' (here two launchers on loopback) joins one 2-process job."""
    run, port = tmp_path / "multi", _free_port()
    common = ["-m", "plait", "train", str(tiny_config), "--out", str(run), "--set", "train.steps=4", *QUICK,
              "--set", "launch.nnodes=2", "--set", f"launch.rdzv_endpoint=127.0.0.1:{port}"]
    nodes = [subprocess.Popen([sys.executable, *common, "--set", f"launch.node_rank={r}"], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [n.communicate(timeout=240)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert sum("2 processes (dp=2, DDP)" in o for o in outs) == 1  # one job, one rank 0


def test_a_dry_run_calls_no_data_factory(tmp_path, monkeypatch):
    """Issue 37 N8: --dry-run starts nothing, the user's data code included."""
    from plait.cli import main

    marker = tmp_path / "called"
    (tmp_path / "mydata.py").write_text(f"def make():\n    open({str(marker)!r}, 'w').close()\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--dry-run", "--set", "data.factory=mydata:make", "--set", "model.name=mlp",
                 "--out", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "config.toml").is_file() and not marker.exists()


def test_a_dry_run_without_out_leaves_no_run_directory(tmp_path, monkeypatch, capsys):
    """Issue 57 item 5: `plait train --dry-run` checks the job and writes nothing unless --out names a folder."""
    from plait.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--dry-run"]) == 0
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "config valid; 2 process(es); nothing written (give --out DIR to keep its checked config.toml for torchrun)")


def test_out_onto_a_folder_that_is_not_a_run_is_refused(tmp_path, monkeypatch, capsys):
    """docs/security.md row 12: --out on a foreign folder overwrote its files, appended to metrics.jsonl, then crashed."""
    from plait.cli import main

    monkeypatch.chdir(tmp_path)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "metrics.jsonl").write_text("precious\n")
    assert main(["train", "--dry-run", "--out", str(foreign)]) == 2
    err = capsys.readouterr().err
    assert "is a folder that holds other files and is not a plait run" in err and len(err.strip().splitlines()) == 1
    assert [p.name for p in foreign.iterdir()] == ["metrics.jsonl"]
    assert (foreign / "metrics.jsonl").read_text() == "precious\n"
    (tmp_path / "file").write_text("x")
    assert main(["train", "--dry-run", "--out", str(tmp_path / "file")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", "--dry-run", "--out", str(empty)]) == 0  # an empty folder is fine
    assert main(["train", "--dry-run", "--out", str(empty)]) == 0  # and so is a run's own (config.toml, no checkpoints yet)


def test_every_argument_of_every_verb_has_help_and_shows_its_default():
    """issue 38 item 11: no argument without a description, no option whose default the help hides."""
    import argparse

    from plait.cli import _Defaults, build_parser

    fmt, missing = _Defaults("plait"), []

    def walk(parser, path):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, f"{path} {name}")
            elif not isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
                text = fmt._get_help_string(a)
                if not a.help:
                    missing.append(f"{path}: {a.dest} has no help")
                elif a.option_strings and a.default not in (None, False, [], argparse.SUPPRESS) and \
                        "default" not in text.lower():
                    missing.append(f"{path}: {a.dest} hides its default")

    walk(build_parser(), "plait")
    assert not missing, missing
    assert "(default: 8000)" in build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
