"""`plait launch` runs a user's own loop (examples/own_loop.py: plain SGD on digits, plait.parallelize) in the
layout's processes; at dp = 2 and at ZeRO-3 its steps and weights are those of the same script on one process."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import ENV

ROOT = Path(__file__).resolve().parents[2]
LOOP = ROOT / "examples" / "own_loop.py"
BASE = "[train]\nsteps = 6\nglobal_batch_size = 32\nmicro_batch_size = 16\n[parallel]\ndp = 1\n"


def single(config: Path, out: Path) -> None:
    """The loop as `PLAIT_CONFIG=config python own_loop.py out`, in this process (no process group)."""
    argv, os.environ["PLAIT_CONFIG"] = sys.argv, str(config)
    try:
        sys.argv = [str(LOOP), str(out)]
        runpy.run_path(str(LOOP), run_name="__main__")
    finally:
        sys.argv = argv
        del os.environ["PLAIT_CONFIG"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("own_loop")
    (tmp / "base.toml").write_text(BASE)
    jobs = []  # both launches at once: most of their time is importing torch, which overlaps
    for name, sets in (("dp2", ["parallel.dp=2"]), ("zero3", ["parallel.dp=2", "parallel.zero=3"])):
        args = [a for s in sets for a in ("--set", s)]
        cmd = ["launch", *args, "--out", tmp / f"run-{name}", tmp / "base.toml", LOOP, tmp / name]
        jobs.append(subprocess.Popen([sys.executable, "-m", "plait", *map(str, cmd)], cwd=tmp, env=ENV, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    single(tmp / "base.toml", tmp / "one")
    for job in jobs:
        out = job.communicate(timeout=240)[0]
        assert job.returncode == 0, out
    return tmp


@pytest.mark.parametrize("layout", ["dp2", "zero3"])
def test_own_loop_under_plait_launch_matches_one_process(runs, layout):
    one, got = (json.loads((runs / d / "steps.json").read_text()) for d in ("one", layout))
    assert len(one) == 6
    for a, b in zip(one, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], abs=1e-5)
    w1, w2 = (torch.load(runs / d / "weights.pt") for d in ("one", layout))
    assert w1.keys() == w2.keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) <= 1e-5
    assert (runs / layout / "checkpoints" / "latest").resolve().name == "step_0000006"
    config = (runs / f"run-{layout}" / "config.toml").read_text()  # what PLAIT_CONFIG pointed the workers at
    assert "dp = 2" in config and ("zero = 3" in config) == (layout == "zero3")


@pytest.mark.parametrize("args, message", [
    (["launch"], "error: plait launch needs a script: plait launch [CONFIG] [--set launch.KEY=VALUE ...] script.py "
                 "[args...]"),
    (["launch", "nowhere.py"], "error: plait launch nowhere.py: not a Python file here; give the path of your script "
                               "(script.py)"),
    (["launch", "--set", "parallel.dp=3", str(LOOP)],
     "error: train.global_batch_size (32) must be divisible by train.micro_batch_size (16) * parallel.dp (3) = 48; "
     "change train.global_batch_size to a multiple of 48 or lower train.micro_batch_size"),
    (["launch", "--set", "parallel.sync=ps", str(LOOP)],
     "error: plait.parallelize: parallel.sync = 'ps' gives ranks roles (servers that do not train) that only plait "
     "train runs; use parallel.sync='allreduce' or 'gossip' in your own loop"),
])
def test_bad_launches_exit_2_before_any_process_starts(tmp_path, capsys, args, message):
    from plait.cli import main

    assert main([*args[:1], "--out", str(tmp_path / "run"), *args[1:]]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [message]
    assert not (tmp_path / "run").exists()


def test_a_model_the_layout_cannot_cut_is_one_line_and_exit_2_in_a_launched_script(tmp_path, monkeypatch, capsys):
    """What each rank of `plait launch --set parallel.pp=2 --set parallel.dp=1 bad.py` does, before any process group."""
    import plait

    (tmp_path / "c.toml").write_text("[parallel]\ndp = 1\npp = 2\n")
    monkeypatch.setenv("PLAIT_CONFIG", str(tmp_path / "c.toml"))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        plait.parallelize(torch.nn.Linear(64, 10), loss=torch.nn.functional.cross_entropy)
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: parallel.pp = 2 cuts the model into stages, but Linear is no nn.Sequential and has no "
        "`pipeline_parts()` naming its blocks (docs/models.md); set parallel.pp=1"]


def test_save_and_load_resume_the_loop(tmp_path):
    """p.save then p.load in a new Parallel: the step and the weights come back (one process, DCP)."""
    import plait
    from plait.config import load_config

    cfg = load_config(None, ["parallel.dp=1", "train.steps=4", "train.global_batch_size=8", "train.micro_batch_size=8"])
    data = torch.utils.data.TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)))
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731

    def run(steps: int, resume: bool):
        torch.manual_seed(0)
        p = plait.parallelize(torch.nn.Sequential(torch.nn.Linear(6, 3)), cfg, loss=torch.nn.functional.cross_entropy,
                              optimizer=sgd)
        if resume:
            assert p.load(tmp_path / "ckpt") == 2
        losses = [p.step(b).loss for b in p.batches(data, steps=steps)]
        return p, losses

    straight, losses = run(4, False)
    half, first = run(2, False)
    half.save(tmp_path / "ckpt")
    rest, second = run(2, True)  # steps counts from the loaded step: 2 more
    assert first + second == losses and len(second) == 2
    assert all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), rest.state_dict().values(), strict=True))
    for p in (straight, half, rest):
        p.close()


def _two_loops_in_one_group():
    """Pool task: parallelize twice in the harness's process group; close() must leave the group to the harness."""
    import torch.distributed as dist

    import plait
    from plait.config import load_config

    cfg = load_config(None, ["parallel.dp=2", "train.global_batch_size=8", "train.micro_batch_size=4"])
    data = torch.utils.data.TensorDataset(torch.randn(16, 6), torch.randint(0, 3, (16,)))
    losses = []
    for _ in range(2):
        torch.manual_seed(0)
        p = plait.parallelize(torch.nn.Sequential(torch.nn.Linear(6, 3)), cfg, loss=torch.nn.functional.cross_entropy,
                              optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
        losses.append([p.step(b).loss for b in p.batches(data, steps=2)])
        p.close()
    assert dist.is_initialized()
    return losses


def test_close_leaves_a_process_group_it_did_not_make(pool2):
    first, second = pool2.run(_two_loops_in_one_group)[0]
    assert first == second and len(first) == 2


def test_batches_counts_steps_so_an_epoch_loop_goes_on_and_an_empty_range_is_an_error():
    import plait
    from plait.config import load_config
    from plait.errors import ConfigError

    cfg = load_config(None, ["parallel.dp=1", "train.steps=4", "train.global_batch_size=8", "train.micro_batch_size=8"])
    data = torch.utils.data.TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)))
    p = plait.parallelize(torch.nn.Linear(6, 3), cfg, loss=torch.nn.functional.cross_entropy)
    per_epoch = [sum(1 for b in p.batches(data, steps=2) if p.step(b)) for _ in range(3)]  # three "epochs" of 2
    assert per_epoch == [2, 2, 2] and p.steps_done == 6
    with pytest.raises(ConfigError) as e:
        p.batches(data)  # step 6, train.steps = 4: nothing left
    assert str(e.value) == ("p.batches(): the loop is at step 6 and train.steps = 4: nothing is left to draw; pass "
                            "steps=N for N more steps, or raise train.steps")
    with pytest.raises(ConfigError, match=r"p.batches\(steps=0\): steps counts the steps to draw"):
        p.batches(data, steps=0)
    p.close()


def _save_on_rank0_only(tmp: str):
    """Pool task: p.save under `if p.is_main:` (PyTorch's DDP tutorial's habit) names the call instead of hanging."""
    import torch.distributed as dist

    import plait
    from plait import userloop
    from plait.config import load_config

    cfg = load_config(None, ["parallel.dp=2", "train.global_batch_size=8", "train.micro_batch_size=4"])
    p = plait.parallelize(torch.nn.Linear(6, 3), cfg, loss=torch.nn.functional.cross_entropy)
    userloop.ARRIVAL_S, message = 1.0, None
    t0 = time.monotonic()
    try:  # rank 0 saves alone while rank 1 has gone on to the next collective call
        p.save(tmp) if p.is_main else p.state_dict()
    except userloop.CollectiveError as e:
        message = str(e)
    waited = time.monotonic() - t0
    userloop.ARRIVAL_S = 60.0
    dist.barrier()  # both attempts over before either saves again (a rank early here must not meet the other's)
    p.save(tmp)  # called by both ranks, it goes through
    p.close()
    assert dist.is_initialized()
    return message, waited


def test_a_collective_call_on_one_rank_names_itself_instead_of_hanging(pool2, tmp_path):
    (message, waited), (other, _) = pool2.run(_save_on_rank0_only, str(tmp_path))
    assert message == ("p.save is collective: call it on every rank, not inside `if p.is_main:` (1 of 2 ranks called "
                       "it within 1 s)")
    assert other.startswith("p.state_dict is collective: call it on every rank") and 1.0 <= waited < 30
    assert (tmp_path / "checkpoints" / "step_0000000").is_dir()
