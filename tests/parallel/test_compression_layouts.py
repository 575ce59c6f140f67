"""Top-k and PowerSGD where no DDP bucket carries the gradient: what ZeRO-2/3 reduce-scatter (FSDP2 units, in pipeline
stages too), ZeRO-1's flat buffer and tensor-parallel shards averaged over dp.

Top-k keeping every entry (topk_ratio = 1) is the exact average: one process's trajectory under plain SGD. With 5 %
kept, each unit's reduce-scatter becomes an all-gather of (dp - 1) x 2k x 4 bytes, k = ceil(0.05 N) of its N entries.
PowerSGD of rank r is exact where every averaged gradient has rank <= r: an MLP's weight gradients over a global batch
of 4 samples have rank 4, so PowerSGD of rank 4 compresses them (each matrix sent as P and Q) and still follows the
one-process trajectory. A tensor-parallel GPT's are not low rank: there PowerSGD is checked to save bytes and keep
the losses near the plain run's."""

from __future__ import annotations

import json
import math

import pytest

from helpers import PLAIN_SGD, max_diff, params_after, step_losses, tiny_gpt_config

MLP = ["model.name=mlp", "data.name=digits", "model.width=64", "model.depth=2", "train.global_batch_size=4",
       "train.micro_batch_size=2", "train.steps=5", "train.eval_samples=16", "log.every=1", "log.progress=false",
       "log.report=false", "optim.lr=0.5", "optim.schedule=constant", "optim.warmup_steps=0", *PLAIN_SGD]


def compressed_run(cfg, run_dir):
    """Pool task: rank 0's weights, per-step bytes sent and logged uncompressed bytes, and the entries of each FSDP2
    unit's reduce-scatter (its parameters' padded gradients)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    from plait.train.trainer import train

    result = train(cfg, run_dir)
    s = result.strategy
    units = []
    for part in getattr(s, "parts", [s.model]):
        for m in part.modules():
            state = _get_module_fsdp_state(m) if hasattr(m, "set_custom_reduce_scatter") else None
            if state is not None and state._fsdp_param_group is not None:
                n = dist.get_world_size(state._fsdp_param_group.mesh_info.shard_process_group)
                units.append(sum(n * torch.Size(fp.padded_sharded_param_size).numel()
                                 for fp in state._fsdp_param_group.fsdp_params))
    weights = s.full_model_state_dict()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    if dist.get_rank() != 0:
        return None
    return weights, [r["comm_bytes"] for r in rows], [r.get("uncompressed_bytes") for r in rows], units


def assert_one_process(one: dict, got: dict, one_dir, got_dir, tol: float = 1e-5) -> None:
    assert max_diff(one, got) < tol
    for (a, g), (b, h) in zip(step_losses(one_dir), step_losses(got_dir), strict=True):
        assert b == pytest.approx(a, rel=tol) and h == pytest.approx(g, rel=tol)


@pytest.fixture(scope="module")
def mlp_one(tmp_path_factory):
    from plait.config import load_config

    run = tmp_path_factory.mktemp("mlp") / "one"
    return params_after(load_config(None, [*MLP, "parallel.dp=1"]), run), run


@pytest.mark.parametrize("zero", [2, 3])
def test_topk_of_zero_reduce_scatters(pool2, mlp_one, tmp_path, zero):
    from plait.config import load_config

    one, one_dir = mlp_one
    layout = ["parallel.dp=2", f"parallel.zero={zero}", "parallel.compression='topk'"]
    every = pool2.run(compressed_run, load_config(None, [*MLP, *layout, "parallel.topk_ratio=1.0"]), tmp_path / "all")[0]
    assert_one_process(one, every[0], one_dir, tmp_path / "all")
    plain = pool2.run(compressed_run, load_config(None, [*MLP, "parallel.dp=2", f"parallel.zero={zero}"]),
                      tmp_path / "plain")[0]
    _, sent, raw, units = pool2.run(compressed_run, load_config(None, [*MLP, *layout, "parallel.topk_ratio=0.05"]),
                                    tmp_path / "sparse")[0]
    assert len(units) == (3 if zero == 3 else 1)  # ZeRO-3: the MLP's two blocks and the root (the head); ZeRO-2: the root
    rs = sum((2 - 1) / 2 * 4 * n for n in units)  # the plain reduce-scatters' bytes
    gathers = sum((2 - 1) * 2 * math.ceil(0.05 * n) * 4 for n in units)
    assert raw == pytest.approx([rs] * 5, rel=1e-9)
    assert [p - s for p, s in zip(plain[1], sent)] == pytest.approx([rs - gathers] * 5, rel=1e-9)


@pytest.mark.parametrize("layout", [("parallel.zero=1",), ("parallel.zero=2",), ("parallel.zero=3",)])
def test_low_rank_powersgd_under_zero_is_the_exact_average(pool2, mlp_one, tmp_path, layout):
    from plait.config import load_config

    one, one_dir = mlp_one
    cfg = load_config(None, [*MLP, "parallel.dp=2", *layout, "parallel.compression='powersgd'",
                             "parallel.powersgd_rank=4"])
    got = pool2.run(compressed_run, cfg, tmp_path / "psgd")[0]
    assert_one_process(one, got[0], one_dir, tmp_path / "psgd")
    plain = pool2.run(compressed_run, load_config(None, [*MLP, "parallel.dp=2", *layout]), tmp_path / "plain")[0]
    # torch's PowerSGD starts at its third step: the first two are plain all-reduces, twice a reduce-scatter's bytes
    assert [s - p for s, p in zip(got[1][:2], plain[1][:2])] == pytest.approx(got[2][:2], rel=1e-9)
    # from then on each 64 x 64 / 10 x 64 weight travels as P and Q (rank 4) and the biases whole
    assert all(p - s > 0.5 * r for p, s, r in zip(plain[1][2:], got[1][2:], got[2][2:])), (plain[1], got[1], got[2])


def test_topk_and_powersgd_of_zero3_inside_pipeline_stages(pool4, tiny_text, tmp_path):
    """pp2 + ZeRO-3: each stage's FSDP2 units reduce-scatter over the stage's dp ranks, compressed. Top-k at ratio 1 is
    the one-process trajectory; PowerSGD (rank 1) saves bytes on losses near the plain run's."""
    base = [*PLAIN_SGD, "train.steps=4", "log.every=1", "train.micro_batch_size=2", "parallel.dp=2", "parallel.pp=2",
            "parallel.zero=3"]
    one = params_after(tiny_gpt_config(tiny_text, *base[:-3], "parallel.dp=1"), tmp_path / "one")
    every = pool4.run(compressed_run, tiny_gpt_config(tiny_text, *base, "parallel.compression='topk'",
                                                      "parallel.topk_ratio=1.0"), tmp_path / "all")[0]
    assert_one_process(one, every[0], tmp_path / "one", tmp_path / "all", tol=1e-4)
    plain = pool4.run(compressed_run, tiny_gpt_config(tiny_text, *base), tmp_path / "plain")[0]
    psgd = pool4.run(compressed_run, tiny_gpt_config(tiny_text, *base, "parallel.compression='powersgd'",
                                                     "parallel.powersgd_rank=1"), tmp_path / "psgd")[0]
    assert all(p > s for p, s in zip(plain[1][2:], psgd[1][2:])), (plain[1], psgd[1])
    for (a, _), (b, _) in zip(step_losses(tmp_path / "plain"), step_losses(tmp_path / "psgd"), strict=True):
        assert b == pytest.approx(a, rel=0.1)


def test_powersgd_of_tensor_parallel_shards_along_dp(pool4, tiny_text, tmp_path):
    """dp2 x tp2: each rank's shards averaged over dp by PowerSGD (rank 1): bytes saved from its third step, the
    first two plain; losses near the plain run's."""
    base = [*PLAIN_SGD, "train.steps=4", "log.every=1", "parallel.dp=2", "parallel.tp=2", "train.micro_batch_size=2",
            "model.vocab_multiple=64"]
    plain = pool4.run(compressed_run, tiny_gpt_config(tiny_text, *base), tmp_path / "plain")[0]
    psgd = pool4.run(compressed_run, tiny_gpt_config(tiny_text, *base, "parallel.compression='powersgd'",
                                                     "parallel.powersgd_rank=1"), tmp_path / "psgd")[0]
    assert psgd[1][:2] == pytest.approx(plain[1][:2], rel=1e-9)
    assert all(p > 2 * s for p, s in zip(plain[1][2:], psgd[1][2:])), (plain[1], psgd[1])
    for (a, _), (b, _) in zip(step_losses(tmp_path / "plain"), step_losses(tmp_path / "psgd"), strict=True):
        assert b == pytest.approx(a, rel=0.1)


def test_topk_and_powersgd_of_zero3_with_context_parallel(pool2, tiny_text, tmp_path):
    """cp2 + ZeRO-3: the cp ranks are replicas FSDP2 shards over; their reduce-scatters compressed alike (top-k at
    ratio 1: one process's trajectory; PowerSGD of rank 1 saves bytes from its third step)."""
    base = [*PLAIN_SGD, "train.steps=4", "log.every=1"]
    one = params_after(tiny_gpt_config(tiny_text, *base, "parallel.dp=1"), tmp_path / "one")
    layout = ["parallel.dp=1", "parallel.cp=2", "parallel.zero=3"]
    every = pool2.run(compressed_run, tiny_gpt_config(tiny_text, *base, *layout, "parallel.compression='topk'",
                                                      "parallel.topk_ratio=1.0"), tmp_path / "all")[0]
    assert_one_process(one, every[0], tmp_path / "one", tmp_path / "all", tol=1e-4)
    plain = pool2.run(compressed_run, tiny_gpt_config(tiny_text, *base, *layout), tmp_path / "plain")[0]
    psgd = pool2.run(compressed_run, tiny_gpt_config(tiny_text, *base, *layout, "parallel.compression='powersgd'",
                                                     "parallel.powersgd_rank=1"), tmp_path / "psgd")[0]
    assert all(p > s for p, s in zip(plain[1][2:], psgd[1][2:])), (plain[1], psgd[1])
    for (a, _), (b, _) in zip(step_losses(tmp_path / "plain"), step_losses(tmp_path / "psgd"), strict=True):
        assert b == pytest.approx(a, rel=0.1)
