"""The model registry's own checks, and what a model can do, asked before any worker starts."""

import re

import pytest

from plait.config import load_config
from plait.errors import ConfigError
from plait.models import capabilities
from plait.train.job import load_job


def bad(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_job(None, overrides)


def test_width_must_divide_by_heads():
    bad(["model.width=100", "model.heads=3"],
        "model.width (100) must be divisible by model.heads (3); change one of them (e.g. width=99)")


def test_model_and_data_must_fit():
    bad(["data.name=digits"], "model.name = 'gpt' cannot train on data.name = 'digits': it needs a text source "
                              "(stdlib-text, text or chat); change model.name or data.name")
    bad(["model.name=mlp"], "model.name = 'mlp' cannot train on data.name = 'stdlib-text': it needs digits, "
                            "synthetic or tensors")
    # a factory model is not checked against the data
    assert load_job(None, ["model.factory=torch.nn:Linear", "data.name=digits"]).model.factory == "torch.nn:Linear"


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.layers=0", "model.layers = 0 must be >= 1"),
        ("model.name=resnet", "model.name = 'resnet' is not a registered model; choose one of: cnn, deepfm, gpt, llama, mlp"),
        ("model.factory=mymodule.build", "model.factory = 'mymodule.build' must be 'package.module:function'"),
    ],
)
def test_registry_checks(override, message):
    bad([override], message)


def test_capabilities_of_registered_and_factory_models():
    assert capabilities(load_config().model) == {"pipeline", "tensor_parallel"}
    assert capabilities(load_config(None, ["model.name=mlp", "data.name=digits"]).model) == frozenset()
    # a factory is built on the meta device and asked
    cfg = load_config(None, ["model.factory=torch.nn:Linear", "model.options={in_features = 4, out_features = 2}"])
    assert capabilities(cfg.model) == frozenset()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.name=mlp", "data.name=digits", "parallel.pp=2", "parallel.dp=1"],
         "parallel.pp = 2 cuts the model into stages, but model.name = 'mlp' has no pipeline cut points (an "
         "nn.Sequential, or a `pipeline_parts()` method naming its blocks, see docs/models.md); set parallel.pp=1"),
        (["model.factory=torch.nn:Linear", "model.options={in_features = 4, out_features = 2}", "data.name=digits",
          "parallel.tp=2", "parallel.dp=1"],
         "parallel.tp = 2 splits the model's matrices, but torch.nn:Linear declares no tensor-parallel plan "
         "(a `tp_plan(sequence_parallel)` method; `tp_plan = megatron_plan` for the common patterns, see "
         "docs/models.md; a transformers model: its class's _tp_plan); set parallel.tp=1"),
    ],
)
def test_layouts_a_model_cannot_take_are_refused_before_launch(overrides, message):
    bad(overrides, message)


def test_the_cli_exits_2_before_any_worker_starts(tmp_path, capsys):
    from plait.cli import main

    code = main(["train", "--set", "model.name=mlp", "--set", "data.name=digits", "--set", "parallel.pp=2",
                 "--set", "parallel.dp=1", "--out", str(tmp_path / "run")])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: parallel.pp = 2 cuts the model into stages, but model.name = 'mlp' has no pipeline cut points (an "
        "nn.Sequential, or a `pipeline_parts()` method naming its blocks, see docs/models.md); set parallel.pp=1"]
    assert not (tmp_path / "run" / "logs").exists()  # no worker was started
