"""parallel.compression = fp16 | bf16 under ZeRO-2/3: FSDP2 reduce-scatters the gradients in that dtype. The bytes a
rank sends per step fall by exactly what the reduce-scatter saves (n parameters x 2 bytes x (dp - 1) / dp), and the
run stays within the dtype's rounding of the uncompressed one while differing from it (so the cast happened)."""

from __future__ import annotations

import json

import pytest

from helpers import rank0_params, step_losses

BASE = ["model.name=mlp", "data.name=digits", "model.width=64", "model.depth=2", "parallel.dp=2",
        "train.global_batch_size=32", "train.micro_batch_size=16", "train.steps=5", "train.eval_samples=64",
        "checkpoint.every=0", "log.every=1", "log.progress=false", "log.report=false", "optim.name=sgd",
        "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0", "optim.warmup_steps=0", "optim.lr=0.5",
        "optim.schedule=constant"]


@pytest.mark.parametrize("zero, dtype, rtol", [(3, "fp16", 2e-3), (2, "bf16", 2e-2)])
def test_compressed_reduce_scatter_sends_half_and_keeps_the_trajectory(pool2, tmp_path, zero, dtype, rtol):
    from plait.config import load_config

    runs = {}
    for name in ("none", dtype):
        cfg = load_config(None, [*BASE, f"parallel.zero={zero}", f"parallel.compression={name}"])
        weights = pool2.run(rank0_params, cfg, tmp_path / name)[0]
        runs[name] = (weights, step_losses(tmp_path / name), json.loads((tmp_path / name / "summary.json").read_text()))
    (w0, l0, s0), (w1, l1, s1) = runs["none"], runs[dtype]
    n = s0["trainable_params"]
    sent0, sent1 = (s["comm"]["bytes_per_step_per_rank"][0] for s in (s0, s1))
    assert sent0 - sent1 == pytest.approx(n * 2 * (2 - 1) / 2, rel=1e-3), (sent0, sent1, n)
    moved = max((w0[k] - w1[k]).abs().max().item() for k in w0)
    assert 0 < moved < rtol, moved
    for (a, g), (b, h) in zip(l0, l1):
        assert b == pytest.approx(a, rel=rtol) and h == pytest.approx(g, rel=rtol)
