"""LoRA: plait's layer against peft's (outputs and gradients), merge/unmerge, training at dp and ZeRO-3, export."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
from ft_helpers import assert_same, gpt, run_trajectory, val_loss

from plait.config import load_config
from plait.errors import CheckpointError, ConfigError
from plait.export import export, load_exported
from plait.finetune import LoRALinear, apply_lora, merge_lora
from plait.train.job import check_job
from plait.train.weights import load_run_model

LORA = ("finetune.lora_rank=4", "finetune.lora_alpha=8.0", "finetune.lora_targets=['*attn.q', '*attn.v', '*mlp.up']")


def test_lora_matches_peft_on_the_same_layer_with_the_same_weights():
    peft = pytest.importorskip("peft", reason="peft is in the dev extra only")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 6))
    ours = copy.deepcopy(base)
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=3, lora_alpha=5, target_modules=["0", "2"],
                                                                       lora_dropout=0.0))
    apply_lora(ours, rank=3, alpha=5, targets=["0", "2"])
    for name in ("0", "2"):
        layer = theirs.base_model.model.get_submodule(name)
        with torch.no_grad():  # B random (peft and plait both start it at zero, which would hide a wrong B or scale)
            layer.lora_A["default"].weight.copy_(torch.randn_like(layer.lora_A["default"].weight))
            layer.lora_B["default"].weight.copy_(torch.randn_like(layer.lora_B["default"].weight))
            ours.get_submodule(name).lora_A.copy_(layer.lora_A["default"].weight)
            ours.get_submodule(name).lora_B.copy_(layer.lora_B["default"].weight)
    x = torch.randn(7, 12, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y_ours, y_theirs = ours(x), theirs(x2)
    torch.testing.assert_close(y_ours, y_theirs, rtol=0, atol=1e-6)
    (y_ours ** 2).sum().backward()
    (y_theirs ** 2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=1e-6)
    for name in ("0", "2"):
        layer = theirs.base_model.model.get_submodule(name)
        torch.testing.assert_close(ours.get_submodule(name).lora_A.grad, layer.lora_A["default"].weight.grad, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours.get_submodule(name).lora_B.grad, layer.lora_B["default"].weight.grad, rtol=0, atol=1e-5)
        assert ours.get_submodule(name).weight.grad is None  # the base is frozen in both
    trainable = lambda m: sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert trainable(ours) == trainable(theirs) == 3 * (12 + 10) + 3 * (10 + 6)


def test_merge_unmerge_and_the_plain_model_it_becomes():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    plain_names = {k: v.shape for k, v in model.state_dict().items()}
    apply_lora(model, rank=2, alpha=4, targets=["*"])
    for layer in (model[0], model[2]):
        nn.init.normal_(layer.lora_B)
    x = torch.randn(5, 8)
    y = model(x)
    w0 = model[0].weight.clone()
    model[0].merge()
    torch.testing.assert_close(model(x), y, rtol=0, atol=1e-5)
    assert not torch.allclose(model[0].weight, w0)
    model[0].unmerge()
    torch.testing.assert_close(model[0].weight, w0, rtol=0, atol=1e-6)
    merge_lora(model)
    assert all(type(m) is nn.Linear for m in (model[0], model[2]))
    assert {k: v.shape for k, v in model.state_dict().items()} == plain_names
    torch.testing.assert_close(model(x), y, rtol=0, atol=1e-5)
    with pytest.raises(ConfigError, match=r"'\*attn\*' matches no Linear layer name; the closest are"):
        apply_lora(nn.Sequential(nn.Linear(2, 2)), 2, 4, ["*attn*"])


def test_base_model_leaves_every_adapter_out_and_puts_it_back():
    """plait.finetune.base_model (peft's disable_adapter()): preference tuning's reference is the base model, with
    trained adapters (B != 0) left out, a merged layer unmerged for the while, bottleneck adapters too."""
    from plait.finetune import apply_adapters, base_model

    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    base = copy.deepcopy(model)
    apply_lora(model, rank=2, alpha=4, targets=["0", "2"])
    apply_adapters(model, 4, ["4"])
    for layer in (model[0], model[2]):
        nn.init.normal_(layer.lora_B)
    nn.init.normal_(model[4].adapter_up.weight)
    model[2].merge()
    x = torch.randn(5, 8)
    tuned = model(x)
    assert (tuned - base(x)).abs().max() > 0.1
    with base_model(model):
        torch.testing.assert_close(model(x), base(x), rtol=0, atol=1e-6)
        assert not model[2].merged
    torch.testing.assert_close(model(x), tuned, rtol=0, atol=1e-6)
    assert model[2].merged


def test_tied_targets_and_unsupported_layouts_are_refused(tiny_text):
    with pytest.raises(ConfigError, match="shared with .*tok_emb.weight.*tied embeddings"):
        check_job(load_config(None, gpt(tiny_text, "finetune.lora_rank=2", "finetune.lora_targets=['head']")))
    with pytest.raises(ConfigError, match="supported with data, tensor, pipeline, context and expert parallel and ZeRO 1-3"):
        check_job(load_config(None, gpt(tiny_text, *LORA, "parallel.sync=gossip")))


@pytest.fixture(scope="module")
def lora_ref(pretrained, tiny_text, tmp_path_factory):
    run = tmp_path_factory.mktemp("lora") / "run"
    cfg = load_config(None, gpt(tiny_text, "parallel.dp=1", *LORA, f"train.init_from='{pretrained}'", "train.steps=3",
                                "checkpoint.every=0"))
    return run, run_trajectory(cfg, run)


def test_only_adapters_train_and_dp_and_zero3_keep_the_trajectory(pool2, lora_ref, pretrained, tiny_text, tmp_path):
    run, ref = lora_ref
    losses, _, params, summary = ref
    _, _, start = load_run_model(pretrained)
    start = start.state_dict()
    assert all(torch.equal(params[k], start[k]) for k in start)  # the base never moves
    adapters = [k for k in params if ".lora_" in k]
    assert len(adapters) == 2 * 3 * 2  # A and B on q, v and up in 2 blocks
    w = 32
    assert summary["trainable_params"] == 2 * 4 * ((w + w) + (w + w) + (w + 4 * w))
    assert losses[-1] < losses[0]
    for i, layout in enumerate([("parallel.dp=2",), ("parallel.dp=2", "parallel.zero=3")]):  # DDP, FSDP2
        got = pool2.run(run_trajectory, load_config(None, gpt(tiny_text, *layout, *LORA,
                                                              f"train.init_from='{pretrained}'")), tmp_path / str(i))[0]
        assert_same(ref, got)


def test_export_merges_by_default_and_writes_adapters_alone_on_request(lora_ref, pretrained, tmp_path):
    run, (_, _, params, summary) = lora_ref
    merged, meta = load_exported(export(run, tmp_path / "m.safetensors"))
    assert all(type(m) is not LoRALinear for m in merged.modules())
    _, _, plain = load_run_model(pretrained)
    assert {k: v.shape for k, v in merged.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    # the merged model reproduces the run's validation loss
    assert abs(val_loss(merged, load_config(run / "config.toml", validate=False)) - summary["val_loss"]) < 1e-5
    from safetensors import safe_open

    path = export(run, tmp_path / "a.safetensors", adapters_only=True)
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(k for k in params if ".lora_" in k)
        assert json.loads(f.metadata()["plait.lora"]) == {"rank": 4, "alpha": 8.0, "targets": ["*attn.q", "*attn.v", "*mlp.up"]}
    with pytest.raises(CheckpointError, match="trained no adapters"):
        export(pretrained, tmp_path / "x.safetensors", adapters_only=True)
