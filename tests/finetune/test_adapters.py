"""Bottleneck adapters (Houlsby, Pfeiffer): the layer against its formula, where they go, only they train, dp and
ZeRO-3 keep the trajectory, and an export keeps them as modules (or writes them alone)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from ft_helpers import assert_same, gpt, run_trajectory, val_loss

from plait.config import load_config
from plait.errors import ConfigError
from plait.export import export, load_exported
from plait.finetune import AdapterLinear, adapter_layers, apply_adapters, targets_of
from plait.train.job import check_job
from plait.train.weights import load_run_model

HOULSBY = ("finetune.adapters={size=4, variant='houlsby'}",)


def test_the_layer_is_its_formula_and_starts_as_the_base():
    torch.manual_seed(0)
    base = nn.Linear(12, 10)
    x = torch.randn(5, 12)
    want0 = base(x)
    layer = AdapterLinear(base, 3)
    torch.testing.assert_close(layer(x), want0, rtol=0, atol=0)  # up starts at zero: the base's outputs exactly
    with torch.no_grad():
        for p in (layer.adapter_up.weight, layer.adapter_up.bias):
            p.normal_()
    d, u = layer.adapter_down, layer.adapter_up
    y = x @ base.weight.T + base.bias
    want = y + F.gelu(y @ d.weight.T + d.bias) @ u.weight.T + u.bias
    torch.testing.assert_close(layer(x), want, rtol=1e-6, atol=1e-6)
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == [
        "adapter_down.weight", "adapter_down.bias", "adapter_up.weight", "adapter_up.bias"]


def test_houlsby_adapts_attention_and_mlp_outputs_pfeiffer_the_mlp_only(tiny_text):
    from plait.data import build_data
    from plait.models import build_model

    cfg = load_config(None, gpt(tiny_text))
    model = build_model(cfg.model, build_data(cfg.data, cfg.model).spec)
    assert targets_of(model, {"variant": "houlsby"}) == ["blocks.0.attn.proj", "blocks.0.mlp.down",
                                                         "blocks.1.attn.proj", "blocks.1.mlp.down"]
    assert targets_of(model, {"variant": "pfeiffer"}) == ["blocks.0.mlp.down", "blocks.1.mlp.down"]
    assert targets_of(model, {"targets": ["*attn.q"]}) == ["blocks.0.attn.q", "blocks.1.attn.q"]
    x = torch.randint(0, 10, (2, 16))
    before = model(x)
    apply_adapters(model, 4, targets_of(model, {"variant": "houlsby"}))
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    w = 32
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 4 * (w * 4 + 4 + 4 * w + w)


@pytest.mark.parametrize("sets, message", [
    (["finetune.adapters={size=0}"], "finetune.adapters.size = 0 must be an integer >= 1 (the bottleneck width), e.g. 16"),
    (["finetune.adapters={sizes=4}"], "finetune.adapters has unknown keys ['sizes']; it takes size, variant and targets"),
    (["finetune.adapters={variant='lora'}"], "finetune.adapters.variant = 'lora': choose houlsby (after attention and "
                                             "MLP) or pfeiffer (after the MLP)"),
    (["finetune.adapters={size=4}", "finetune.lora_rank=2"], "finetune.adapters with finetune.lora_rank > 0: choose "
                                                             "one kind of adapter"),
    (["finetune.adapters={size=4}", "parallel.dp=1", "parallel.tp=2"], "finetune.adapters with parallel.tp = 2 is "
                                                                       "not supported (tensor parallel splits frozen, "
                                                                       "LoRA and QLoRA layers, not bottleneck "
                                                                       "adapters"),
])
def test_bad_settings_are_named(tiny_text, sets, message):
    with pytest.raises(ConfigError) as e:
        check_job(load_config(None, gpt(tiny_text, *sets)))
    assert str(e.value).startswith(message)


@pytest.fixture(scope="module")
def adapters_ref(pretrained, tiny_text, tmp_path_factory):
    run = tmp_path_factory.mktemp("adapters") / "run"
    cfg = load_config(None, gpt(tiny_text, "parallel.dp=1", *HOULSBY, f"train.init_from='{pretrained}'"))
    return run, run_trajectory(cfg, run)


def test_only_adapters_train_and_dp_and_zero3_keep_the_trajectory(pool2, adapters_ref, pretrained, tiny_text, tmp_path):
    run, ref = adapters_ref
    losses, _, params, summary = ref
    _, _, start = load_run_model(pretrained)
    start = start.state_dict()
    assert all(torch.equal(params[k], start[k]) for k in start)  # the base never moves
    assert len([k for k in params if ".adapter_" in k]) == 4 * 4  # down and up, weight and bias, on 4 layers
    assert summary["trainable_params"] == 4 * (32 * 4 + 4 + 4 * 32 + 32)
    assert losses[-1] < losses[0]
    for i, layout in enumerate([("parallel.dp=2",), ("parallel.dp=2", "parallel.zero=3")]):  # DDP, FSDP2
        got = pool2.run(run_trajectory, load_config(None, gpt(tiny_text, *layout, *HOULSBY,
                                                              f"train.init_from='{pretrained}'")), tmp_path / str(i))[0]
        assert_same(ref, got)


def test_export_keeps_the_adapters_as_modules_or_writes_them_alone(adapters_ref, tmp_path):
    run, (_, _, params, summary) = adapters_ref
    model, meta = load_exported(export(run, tmp_path / "m.safetensors"))
    layers = ["blocks.0.attn.proj", "blocks.0.mlp.down", "blocks.1.attn.proj", "blocks.1.mlp.down"]
    assert list(adapter_layers(model)) == layers
    assert json.loads(meta["plait.adapters"]) == {"size": 4, "layers": layers}
    assert all(torch.equal(model.state_dict()[k], params[k]) for k in params)
    # the exported model reproduces the run's validation loss
    assert abs(val_loss(model, load_config(run / "config.toml", validate=False)) - summary["val_loss"]) < 1e-5
    from safetensors import safe_open

    path = export(run, tmp_path / "a.safetensors", adapters_only=True)
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(k for k in params if ".adapter_" in k)
        assert "plait.lora" not in f.metadata() and json.loads(f.metadata()["plait.adapters"])["size"] == 4
