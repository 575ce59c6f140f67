"""LAMB and LARS under ZeRO-2/3: each tensor's trust ratio needs its whole norm, which FSDP2's DTensor shards reduce
across the ranks, so the sharded step is the one-process step (per-step loss, grad norm and weights within 1e-5)."""

from __future__ import annotations

import pytest

from helpers import assert_follows, params_after, rank0_params, step_losses, tiny_gpt_config

BASE = ["train.steps=4", "checkpoint.every=0", "optim.grad_clip=0", "optim.weight_decay=0.01", "optim.warmup_steps=0"]


@pytest.mark.parametrize("optim", [["optim.name=lamb", "optim.lr=1e-2"],
                                   ["optim.name=lars", "optim.lr=0.5", "optim.momentum=0.9"]], ids=["lamb", "lars"])
def test_per_tensor_norm_optimizers_under_zero_follow_one_process(pool2, tiny_text, tmp_path, optim):
    one = params_after(tiny_gpt_config(tiny_text, "parallel.dp=1", *BASE, *optim), tmp_path / "one")
    for zero in (2, 3):
        run = tmp_path / f"z{zero}"
        got = pool2.run(rank0_params, tiny_gpt_config(tiny_text, "parallel.dp=2", f"parallel.zero={zero}", *BASE,
                                                       *optim), run)[0]
        assert_follows((one, step_losses(tmp_path / "one")), got, run, steps=4, rel=1e-5, atol=1e-5)
