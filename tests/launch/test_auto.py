"""launch.nproc_per_node = "auto" and parallel.dp = "auto": every local GPU (a monkeypatched count here), or on CPU
the layout's need; resolved when the config loads, before anything launches, and said by --dry-run."""

import re

import pytest
import torch

from plait.cli import main
from plait.config import auto_notes, load_config
from plait.errors import ConfigError
from plait.parallel.layout import Layout

MLP = ["model.name='mlp'", "data.name='digits'", "train.micro_batch_size=4"]


@pytest.fixture
def gpus(monkeypatch):
    def set_count(n: int):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return set_count


def test_on_cpu_auto_takes_the_layouts_need_and_dp_fills_the_processes_given():
    cfg = load_config(None, [*MLP, "launch.nproc_per_node=auto"])
    assert (cfg.launch.nproc_per_node, cfg.parallel.dp) == (0, 2)
    cfg = load_config(None, [*MLP, "parallel.dp=auto", "launch.nproc_per_node=4"])
    assert cfg.parallel.dp == 4 and auto_notes(cfg) == ["parallel.dp = auto -> 4 (4 processes per machine)"]
    cfg = load_config(None, [*MLP, "parallel.dp=auto", "launch.nproc_per_node=4", "parallel.sync='ps'",
                             "parallel.ps_servers=1"])
    assert cfg.parallel.dp == 3  # the fourth process is the parameter server
    cfg = load_config(None, [*MLP, "parallel.dp=auto", "launch.nproc_per_node=auto"])
    assert (cfg.launch.nproc_per_node, cfg.parallel.dp) == (0, 1)
    assert auto_notes(cfg)[1].startswith("parallel.dp = auto -> 1: no GPU here and launch.nproc_per_node is not set")


def test_on_a_gpu_machine_auto_takes_every_gpu(gpus):
    gpus(8)
    cfg = load_config(None, [*MLP, "launch.nproc_per_node=auto", "parallel.dp=auto"])
    assert (cfg.launch.nproc_per_node, cfg.parallel.dp) == (8, 8)
    assert auto_notes(cfg) == ["launch.nproc_per_node = auto -> 8 (every local GPU)",
                               "parallel.dp = auto -> 8 (8 processes per machine)"]
    cfg = load_config(None, ["parallel.dp=auto", "parallel.tp=2", "train.micro_batch_size=4"])
    assert cfg.parallel.dp == 4 and auto_notes(cfg) == ["parallel.dp = auto -> 4 (8 processes per machine / tp 2 x pp 1)"]
    # launch.device = 'cpu' on a GPU machine: no GPU counts
    assert load_config(None, [*MLP, "launch.device='cpu'", "launch.nproc_per_node=auto"]).launch.nproc_per_node == 0


def test_auto_that_cannot_fill_the_machine_and_other_words_are_errors(gpus):
    gpus(8)
    with pytest.raises(ConfigError, match=re.escape(
            "parallel.dp = auto: no whole parallel.dp fits launch.nproc_per_node(8) * nnodes(1) = 8 processes: dp * tp(3) "
            "* pp(1) = 8 leaves dp = 8 / 3; give the job a multiple of 3 processes, or change parallel.tp; or set "
            "parallel.dp to a number")):
        load_config(None, ["parallel.dp=auto", "parallel.tp=3", "model.heads=3", "model.width=96"])
    with pytest.raises(ConfigError, match=r'^launch.nproc_per_node = .eight. must be a whole number or "auto"'):
        load_config(None, ["launch.nproc_per_node=eight"])
    with pytest.raises(ConfigError, match=r'^parallel.dp = True has the wrong type: it must be a whole number or "auto"'):
        load_config(None, ["parallel.dp=true"])


@pytest.mark.parametrize("axis, per", [("cp", "cp 2 x tp 1 x pp 1"), ("tp", "tp 2 x pp 1"), ("pp", "tp 1 x pp 2")])
def test_auto_dp_counts_every_degree(axis, per):
    """issue 56 item 5: dp = auto with cp, tp or pp = 2 on 2 processes is 1 (cp's was 2, four processes, before)."""
    for procs, dp in ((2, 1), (4, 2)):
        cfg = load_config(None, ["parallel.dp=auto", f"parallel.{axis}=2", f"launch.nproc_per_node={procs}"])
        assert (cfg.parallel.dp, getattr(cfg.parallel, axis)) == (dp, 2)
        assert Layout.from_config(cfg).world_size == procs
        assert auto_notes(cfg) == [f"parallel.dp = auto -> {dp} ({procs} processes per machine / {per})"]


def test_dry_run_shows_what_auto_became(gpus, tmp_path, capsys):
    gpus(4)
    sets = [x for kv in [*MLP, "launch.nproc_per_node=auto", "parallel.dp=auto"] for x in ("--set", kv)]
    assert main(["train", "--dry-run", "--out", str(tmp_path / "run"), *sets]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == ["auto: launch.nproc_per_node = auto -> 4 (every local GPU)",
                       "auto: parallel.dp = auto -> 4 (4 processes per machine)",
                       f"config valid; 4 process(es); wrote {tmp_path / 'run' / 'config.toml'}"]
    saved = load_config(tmp_path / "run" / "config.toml")  # the workers read numbers
    assert (saved.launch.nproc_per_node, saved.parallel.dp) == (4, 4)
