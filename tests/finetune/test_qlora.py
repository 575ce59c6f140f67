"""QLoRA: finetune.quantize_base = "nf4" (bitsandbytes on CPU) under LoRA adapters."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from ft_helpers import gpt, run_trajectory, val_loss

from plait.config import load_config
from plait.errors import ConfigError
from plait.export import export, load_exported
from plait.finetune import LoRALinear, lora_layers
from plait.train.job import check_job
from plait.train.weights import load_run_model

pytest.importorskip("bitsandbytes", reason="bitsandbytes is in the qlora and dev extras")

QLORA = ("finetune.lora_rank=4", "finetune.lora_alpha=8.0", "finetune.lora_targets=['*attn.q', '*attn.v', '*mlp.up']")


def test_an_nf4_base_takes_one_eighth_of_fp32_plus_a_scale_per_64_values():
    torch.manual_seed(0)
    base = nn.Linear(128, 96)
    layer = LoRALinear(base, rank=4, alpha=8, quantize="nf4")
    n = 128 * 96
    assert layer.base_bytes() == n // 2 + 4 * (n // 64)  # 4 bits per weight + an fp32 absmax per block of 64
    assert layer.base_bytes() <= (1 / 8 + 1 / 16) * 4 * n
    w = layer.base_weight()
    err = (w - base.weight).abs()
    assert float(err.max()) <= float(base.weight.abs().max()) * 0.2 and float(err.mean()) < 0.1 * float(base.weight.abs().mean())
    nn.init.normal_(layer.lora_B)
    x = torch.randn(3, 128)
    torch.testing.assert_close(layer(x), x @ w.T + base.bias + layer.scale * (x @ layer.lora_A.T @ layer.lora_B.T),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(layer.to_linear()(x), layer(x), rtol=0, atol=1e-5)
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["lora_A", "lora_B"]
    # the header's counts: the nf4 base counts as the weights it stands for, the same as LoRA's fp32 base
    from types import SimpleNamespace

    from plait.runtime import single_process
    from plait.train.telemetry import model_counts

    counts = {q: model_counts(SimpleNamespace(module=LoRALinear(nn.Linear(128, 96), rank=4, alpha=8, quantize=q)),
                              SimpleNamespace(pp=1), single_process()) for q in ("nf4", "none")}
    assert counts["nf4"] == counts["none"] == (n + 96 + 4 * 128 + 96 * 4, 4 * 128 + 96 * 4)


def test_qlora_trains_and_exports_a_plain_model(pretrained, tiny_text, tmp_path):
    more = (*QLORA, f"train.init_from='{pretrained}'", "checkpoint.every=0")
    q = run_trajectory(load_config(None, gpt(tiny_text, "parallel.dp=1", *more, "finetune.quantize_base='nf4'")),
                       tmp_path / "q")
    full = run_trajectory(load_config(None, gpt(tiny_text, "parallel.dp=1", *more)), tmp_path / "f")
    assert q[0][-1] < q[0][0]
    # the quantized base moves the validation loss only a little from full-precision LoRA's
    assert abs(q[3]["val_loss"] - full[3]["val_loss"]) < 0.05 * full[3]["val_loss"], (q[3]["val_loss"], full[3]["val_loss"])
    _, _, trained = load_run_model(tmp_path / "q", merge=False)
    layers = lora_layers(trained)
    assert len(layers) == 6 and all(m.quantize == "nf4" for m in layers.values())
    merged, _ = load_exported(export(tmp_path / "q", tmp_path / "m.safetensors"))
    _, _, plain = load_run_model(pretrained)
    assert {k: v.shape for k, v in merged.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    cfg = load_config(tmp_path / "q" / "config.toml", validate=False)
    assert abs(val_loss(merged, cfg) - q[3]["val_loss"]) < 1e-5
    with pytest.raises(ConfigError, match="set finetune.lora_rank"):
        check_job(load_config(None, gpt(tiny_text, "finetune.quantize_base='nf4'")))


def test_zero3_shards_the_nf4_base_with_its_scales(pool2, pretrained, tiny_text, tmp_path):
    """QLoRA x ZeRO-3 (FSDP-QLoRA): the nf4 codes and their fp32 scales are sharded like any parameter, so at rest a rank
    holds (n/2 + 4 n/64) / dp bytes of the n adapted weights, against LoRA's 4 n / dp: the per-rank parameter bytes in
    summary.json differ by exactly (4 n - n/2 - 4 n/64) / dp. The run is one process's QLoRA trajectory (plain SGD)."""
    from ft_helpers import assert_same

    more = (*QLORA, f"train.init_from='{pretrained}'")
    one = run_trajectory(load_config(None, gpt(tiny_text, "parallel.dp=1", *more, "finetune.quantize_base='nf4'")),
                         tmp_path / "one")
    z3 = ("parallel.dp=2", "parallel.zero=3")
    q = pool2.run(run_trajectory, load_config(None, gpt(tiny_text, *z3, *more, "finetune.quantize_base='nf4'")),
                  tmp_path / "q")[0]
    assert_same(one, q)
    lora = pool2.run(run_trajectory, load_config(None, gpt(tiny_text, *z3, *more)), tmp_path / "lora")[0]
    _, _, plain = load_run_model(pretrained)
    n = sum(plain.get_submodule(name).weight.numel() for name in lora_layers(load_run_model(tmp_path / "q", merge=False)[2]))
    assert n == 2 * (32 * 32 * 2 + 128 * 32)  # q, v and the MLP's up projection in each of 2 blocks
    per_rank = [(a["params_bytes"], b["params_bytes"]) for a, b in zip(lora[3]["memory"]["per_rank"],
                                                                        q[3]["memory"]["per_rank"], strict=True)]
    assert [a - b for a, b in per_rank] == [(4 * n - n // 2 - 4 * n // 64) // 2] * 2, per_rank
    assert q[3]["params"] == lora[3]["params"]  # the nf4 base counts as the weights it stands for
