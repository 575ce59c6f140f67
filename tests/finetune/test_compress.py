"""plait compress: SVD factorisation (rank or energy) and int8 weights, a before/after table, files load_exported takes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from helpers import plait
from plait.compress.core import compress_int8, compress_low_rank, val_loss
from plait.config import load_config
from plait.export import load_exported
from plait.finetune.lowrank import LowRankLinear, energy_rank
from plait.train.weights import load_run_model


def test_a_factorised_layer_is_the_truncated_svd():
    torch.manual_seed(0)
    layer = nn.Linear(12, 9)
    full = LowRankLinear.from_linear(layer, 9)  # full rank: the same map
    x = torch.randn(4, 12)
    torch.testing.assert_close(full(x), layer(x), rtol=0, atol=1e-5)
    r3 = LowRankLinear.from_linear(layer, 3)
    u, s, vh = torch.linalg.svd(layer.weight.detach().double())
    best = (u[:, :3] * s[:3]) @ vh[:3]  # Eckart-Young: the best rank-3 approximation
    torch.testing.assert_close((r3.up.weight @ r3.down.weight).double(), best, rtol=0, atol=1e-5)
    assert sum(p.numel() for p in r3.parameters()) == 3 * (12 + 9) + 9
    w = torch.diag(torch.tensor([3.0, 2.0, 1.0, 0.0]))
    assert energy_rank(w, 0.9) == 2 and energy_rank(w, 0.5) == 1 and energy_rank(w, 1.0) == 3  # 9/14, 13/14, 14/14


def test_low_rank_compression_table_and_the_file_reproduces_its_loss(pretrained, tmp_path):
    cfg, _, model = load_run_model(pretrained)
    report = compress_low_rank(pretrained, tmp_path / "lr.safetensors", rank=4)
    before, after, ranks = report["before"], report["after"], report["ranks"]
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear and n != "head"}  # head: tied
    assert set(ranks) == set(linears) and set(ranks.values()) == {4}
    saved = sum(m.in_features * m.out_features - 4 * (m.in_features + m.out_features) for m in linears.values())
    assert before["params"] - after["params"] == saved
    assert before["linear_flops_per_token"] - after["linear_flops_per_token"] == 2 * saved
    assert "validation loss" in report["table"] and f"{after['params']:,}" in report["table"]
    loaded, _ = load_exported(tmp_path / "lr.safetensors")
    assert isinstance(loaded.get_submodule("blocks.0.attn.q"), LowRankLinear)
    assert val_loss(loaded, cfg, _bundle(cfg)) == pytest.approx(after["val_loss"], abs=1e-6)
    energy = compress_low_rank(pretrained, tmp_path / "e.safetensors", energy=0.8)
    want = {n: energy_rank(m.weight, 0.8) for n, m in linears.items()}
    want = {n: r for n, r in want.items() if r * (linears[n].in_features + linears[n].out_features)
            < linears[n].in_features * linears[n].out_features}  # only where the two factors are smaller
    assert energy["ranks"] == want and want


def _bundle(cfg):
    from plait.data import build_data

    return build_data(cfg.data, cfg.model)


def test_int8_through_torchao_quarters_the_linear_weights_and_keeps_the_loss(pretrained, tmp_path):
    pytest.importorskip("torchao.quantization", reason="torchao is in the lowbit and dev extras")
    report = compress_int8(pretrained, tmp_path / "q.safetensors")
    b, a = report["before"], report["after"]
    rows = sum(m.out_features for n, m in load_run_model(pretrained)[2].named_modules() if type(m) is nn.Linear and n != "head")
    assert a["linear_weight_bytes"] == b["linear_weight_bytes"] // 4 + 4 * rows  # 1 byte per weight + a scale per row
    assert abs(a["val_loss"] - b["val_loss"]) < 0.01 * b["val_loss"]
    loaded, meta = load_exported(tmp_path / "q.safetensors")
    cfg = load_config(pretrained / "config.toml", validate=False)
    assert val_loss(loaded, cfg, _bundle(cfg)) == pytest.approx(a["val_loss"], abs=1e-4)
    # plait serve takes the file as it is, and `plait serve RUN --quantize int8` goes the same torchao path
    from plait.serve.model.load import ModelRef, load_model
    from plait.serve.service import ServeOptions, Service

    service = Service(str(tmp_path / "q.safetensors"), ServeOptions())
    served = service.served.module
    on_the_fly = load_model(ModelRef(str(pretrained), "int8")).module
    for m in (served, on_the_fly):
        assert {n for n, x in m.named_modules() if type(getattr(x, "weight", None)).__name__ == "Int8Tensor"} == set(
            json.loads(meta["plait.quantize"])["layers"])
    x = service.served.example_input(4)
    with torch.inference_mode():
        torch.testing.assert_close(served(x), on_the_fly(x), rtol=0, atol=5e-3)  # the file's scales, re-derived


def test_the_cli_prints_the_table_and_refuses_two_methods(pretrained, tmp_path):
    r = plait("compress", pretrained, "--low-rank", "4", "-o", tmp_path / "m.safetensors")
    assert r.returncode == 0, r.stderr
    assert "parameters" in r.stdout and "Linear FLOPs / token" in r.stdout and (tmp_path / "m.safetensors").is_file()
    r = plait("compress", pretrained, "--low-rank", "4", "--quantize", "int8")
    assert r.returncode == 2 and "one of --low-rank" in r.stderr
