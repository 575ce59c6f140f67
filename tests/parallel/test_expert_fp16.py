"""fp16 loss scaling with expert parallel: torch's fused unscale takes plain tensors or DTensors, not both, so
plait.parallel.base.Precision unscales each gradient's local tensor. The gradients come out divided by the scale, an
overflow on one rank's experts makes every rank skip the step and halve the scale, and an ep2 fp16 run follows the
dp2 fp16 run (the same technique without expert parallel)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import rank0_params, step_losses, tiny_gpt_config

MOE = ["model.moe_experts=4", "model.moe_top_k=2", "precision.dtype=fp16", "train.steps=4", "checkpoint.every=0",
       "optim.name=sgd", "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0", "optim.warmup_steps=0",
       "optim.lr=0.5", "optim.schedule=constant", "parallel.dp=2", "train.micro_batch_size=4"]


def _unscale(poison_rank: int | None):
    """Pool task: a plain and a DTensor parameter, grads = scale x 3, one inf on poison_rank's shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from plait.parallel.base import Precision

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plain = torch.nn.Parameter(torch.ones(3))
    sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    opt = torch.optim.SGD([plain, sharded], lr=1.0)
    p = Precision("fp16", torch.device("cpu"))
    scale = float(p.scaler.scale(torch.ones(())).item())
    plain.grad = torch.full((3,), 3 * scale)
    sharded.grad = distribute_tensor(torch.full((4, 2), 3 * scale), mesh, [Shard(0)])
    if poison_rank == dist.get_rank():
        sharded.grad.to_local()[0, 0] = math.inf
    p.unscale(opt, group=dist.group.WORLD)
    p.step(opt)
    return (plain.grad.tolist(), sharded.grad.to_local().flatten().tolist(), plain.detach().tolist(),
            float(p.scaler.get_scale()), scale)


def test_mixed_dtensor_and_plain_gradients_unscale_and_agree_on_an_overflow(pool2):
    for (g_plain, g_shard, weights, new_scale, scale) in pool2.run(_unscale, None):
        assert g_plain == [3.0] * 3 and g_shard == [3.0] * 4
        assert weights == [-2.0] * 3 and new_scale == scale  # stepped; no overflow, the scale holds (growth later)
    for _, _, weights, new_scale, scale in pool2.run(_unscale, 1):
        assert weights == [1.0] * 3 and new_scale == scale / 2  # every rank skipped the step and halved the scale


def test_ep2_fp16_follows_dp2_fp16(pool2, tiny_text, tmp_path):
    ref = pool2.run(rank0_params, tiny_gpt_config(tiny_text, *MOE), tmp_path / "dp2")[0]
    got = pool2.run(rank0_params, tiny_gpt_config(tiny_text, *MOE, "parallel.ep=2"), tmp_path / "ep2")[0]
    a, b = step_losses(tmp_path / "dp2"), step_losses(tmp_path / "ep2")
    assert len(a) == len(b) == 4
    for (l1, g1), (l2, g2) in zip(a, b):
        assert l2 == pytest.approx(l1, rel=1e-3) and g2 == pytest.approx(g1, rel=1e-3)
    assert ref.keys() == got.keys()
    assert max((ref[k] - got[k]).abs().max().item() for k in ref) < 1e-3
