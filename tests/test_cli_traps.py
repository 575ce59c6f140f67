"""Command-line traps a new user falls into: each gets help or a one-line error naming the fix (in-process CLI)."""

import contextlib
import io

import pytest

from plait.cli import main
from plait.train.telemetry import human_count


def run(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def test_plait_alone_prints_help():
    code, out, err = run()
    assert code == 0 and out.startswith("usage: plait") and "train" in out and err == ""


def test_version():
    from importlib.metadata import version

    code, out, _ = run("--version")
    assert code == 0 and out.strip() == f"plait {version('plait')}"


def test_a_set_without_equals_names_the_slip(tmp_path):
    code, out, err = run("train", "--set", "train.steps", "20", "--out", tmp_path / "r")
    assert code == 2
    assert err.strip() == ("error: --set train.steps: expected SECTION.KEY=VALUE, e.g. --set train.steps=... "
                           "(with '=', no space)")
    assert not (tmp_path / "r").exists()


def test_config_show_takes_a_run_directory(tmp_path):
    code, _, err = run("train", "--set", "train.steps=7", "--out", tmp_path / "r", "--dry-run")
    assert code == 0, err
    code, out, err = run("config", "show", tmp_path / "r")
    assert code == 0, err
    train = out.split("[train]")[1].split("\n[")[0]
    assert any(line.split()[:3] == ["steps", "=", "7"] for line in train.splitlines()), out


@pytest.mark.parametrize("name", ["model.pt", "model", "weights.bin"])
def test_export_refuses_a_suffix_it_would_not_write(tmp_path, name):
    code, _, err = run("export", tmp_path, "-o", tmp_path / name)
    assert code == 2
    assert f"-o {tmp_path / name}: plait writes .safetensors (weights) or an edge export (.onnx, .pt2, .pte)" in err


@pytest.mark.parametrize("n, text", [(12, "12"), (4_800, "4.8K"), (823_456, "823K"), (2_410_000, "2.41M"),
                                     (1_100_000_000, "1.10B")])
def test_parameter_counts_read_as_people_write_them(n, text):
    assert human_count(n) == text


def test_a_factory_that_does_not_import_fails_before_launch(tmp_path):
    code, _, err = run("train", "--set", "model.factory='nope_plait_mod:build'", "--out", tmp_path / "r", "--dry-run")
    assert code == 2
    assert err.startswith("error: model.factory = 'nope_plait_mod:build': cannot import module 'nope_plait_mod'"), err


def test_nccl_without_a_gpu_is_a_config_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: nccl is a valid choice here")
    code, _, err = run("train", "--set", "launch.backend='nccl'", "--out", tmp_path / "r")
    assert code == 2
    assert err.strip() == ("error: launch.backend = 'nccl' needs CUDA GPUs and this machine has none; set "
                           "launch.backend = 'gloo' (or 'auto': nccl on CUDA, else gloo)")
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_the_header_names_every_axis_zero_and_compression():
    from types import SimpleNamespace

    from plait.config import load_config
    from plait.parallel.layout import Layout
    from plait.train.telemetry import layout_text

    cfg = load_config(None, ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=1",
                             "parallel.ep=2", "train.micro_batch_size=4"])
    strategy = SimpleNamespace(name="pipeline-1f1b", labels=["fp16 compression"])  # DDP's build adds its label
    assert layout_text(Layout.from_config(cfg), strategy) == "dp=2 tp=2 pp=2 ep=2, pipeline-1f1b, ZeRO-1, fp16 compression"
    plain = load_config(None, ["parallel.dp=2"])
    assert layout_text(Layout.from_config(plain), SimpleNamespace(name="ddp", labels=[])) == "dp=2, DDP"
    # no jargon: a lone replica's strategy is not named, ZeRO is said once, one process is said in words
    tp = load_config(None, ["parallel.dp=1", "parallel.tp=2"])
    assert layout_text(Layout.from_config(tp), SimpleNamespace(name="single", labels=[])) == "tp=2"
    assert layout_text(Layout.from_config(tp), SimpleNamespace(name="tp+dp", labels=[])) == "tp=2"
    z3 = load_config(None, ["parallel.dp=2", "parallel.zero=3"])
    assert layout_text(Layout.from_config(z3), SimpleNamespace(name="zero3", labels=[])) == "dp=2, ZeRO-3"
    one = load_config(None, ["parallel.dp=1"])
    assert layout_text(Layout.from_config(one), SimpleNamespace(name="single", labels=[])) == "one process"


def test_the_header_names_a_users_data_factory_by_its_path():
    from types import SimpleNamespace

    from plait.train.telemetry import data_text

    cfg = SimpleNamespace(data=SimpleNamespace(factory="mypkg.data:build"))
    assert data_text(cfg, SimpleNamespace(name="factory")) == "your data (mypkg.data:build)"
    assert data_text(SimpleNamespace(data=SimpleNamespace(factory="")), SimpleNamespace(name="digits")) == "digits"
