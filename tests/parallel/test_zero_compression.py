"""parallel.compression = fp16 | bf16 under ZeRO 1-3: FSDP2 (ZeRO-1: its flat buffer) reduce-scatters the gradients
in that dtype. The bytes a rank sends per step fall by exactly what the reduce-scatter saves (n parameters x 2 bytes
x (dp - 1) / dp), and the run stays within the dtype's rounding of the uncompressed one while differing from it (so
the cast happened)."""

from __future__ import annotations

import json

import pytest

from helpers import rank0_params, step_losses

BASE = ["model.name=mlp", "data.name=digits", "model.width=64", "model.depth=2", "parallel.dp=2",
        "train.global_batch_size=32", "train.micro_batch_size=16", "train.steps=5", "train.eval_samples=64",
        "checkpoint.every=0", "log.every=1", "log.progress=false", "log.report=false", "optim.name=sgd",
        "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0", "optim.warmup_steps=0", "optim.lr=0.5",
        "optim.schedule=constant"]


@pytest.mark.parametrize("zero, dtype, rtol", [(3, "fp16", 2e-3), (2, "bf16", 2e-2), (1, "fp16", 2e-3)])
def test_compressed_reduce_scatter_sends_half_and_keeps_the_trajectory(pool2, tmp_path, zero, dtype, rtol):
    from plait.config import load_config

    runs = {}
    for name in ("none", dtype):
        cfg = load_config(None, [*BASE, f"parallel.zero={zero}", f"parallel.compression={name}"])
        weights = pool2.run(rank0_params, cfg, tmp_path / name)[0]
        runs[name] = (weights, step_losses(tmp_path / name), json.loads((tmp_path / name / "summary.json").read_text()))
    (w0, l0, s0), (w1, l1, s1) = runs["none"], runs[dtype]
    n = s0["trainable_params"]
    if zero == 1:  # ZeRO-1 reduce-scatters its flat buffer: every rank's segment padded to the largest owner's load
        from plait.comm.placement import balanced_owners

        sizes = [v.numel() for v in w0.values()]
        owner = balanced_owners(sizes, 2)
        n = 2 * max(sum(s for s, o in zip(sizes, owner) if o == r) for r in range(2))
        assert n > s0["trainable_params"]
    sent0, sent1 = (s["comm"]["bytes_per_step_per_rank"][0] for s in (s0, s1))
    assert sent0 - sent1 == pytest.approx(n * 2 * (2 - 1) / 2, rel=1e-3), (sent0, sent1, n)
    moved = max((w0[k] - w1[k]).abs().max().item() for k in w0)
    assert 0 < moved < rtol, moved
    for (a, g), (b, h) in zip(l0, l1):
        assert b == pytest.approx(a, rel=rtol) and h == pytest.approx(g, rel=rtol)


def trained_with_local_size(cfg, run_dir):
    """Pool task: train; rank 0's weights and how many gradient elements it holds (its tensor-parallel shards)."""
    import torch.distributed as dist

    from plait.train.trainer import train

    result = train(cfg, run_dir)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in result.strategy.module.parameters())
    weights = result.strategy.full_model_state_dict()
    return (weights, local) if dist.get_rank() == 0 else None


def test_fp16_compression_of_a_tensor_parallel_models_dp_average(pool4, tiny_text, tmp_path):
    """dp2 x tp2: the by-hand all-reduce over dp casts each rank's shards to fp16 (torch's fp16 hook's arithmetic): the
    bytes fall by what it saves (a ring all-reduce sends 2 (dp - 1) / dp of the buffer: 2 bytes less per element
    at dp 2), and the run stays within fp16's rounding of the uncompressed one while differing from it."""
    from helpers import PLAIN_SGD, tiny_gpt_config

    runs = {}
    for name in ("none", "fp16"):
        cfg = tiny_gpt_config(tiny_text, "parallel.dp=2", "parallel.tp=2", "train.micro_batch_size=2", "train.steps=4",
                              "model.vocab_multiple=64", *PLAIN_SGD, f"parallel.compression={name}")
        (weights, local) = pool4.run(trained_with_local_size, cfg, tmp_path / name)[0]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        runs[name] = (weights, local, step_losses(tmp_path / name), summary["comm"]["bytes_per_step_per_rank"][0])
    (w0, n, l0, sent0), (w1, _, l1, sent1) = runs["none"], runs["fp16"]
    assert sent0 - sent1 == pytest.approx(n * 2, rel=1e-3), (sent0, sent1, n)
    moved = max((w0[k] - w1[k]).abs().max().item() for k in w0)
    assert 0 < moved < 2e-3, moved
    for (a, g), (b, h) in zip(l0, l1):
        assert b == pytest.approx(a, rel=2e-3) and h == pytest.approx(g, rel=2e-3)


def test_fp16_compression_of_the_dense_part_under_expert_parallel(pool2, tiny_text, tmp_path):
    """dp2 x ep2: DDP's fp16 hook compresses the dense part's all-reduce (each expert lives on one rank here: nothing
    to average): its bytes fall by 2 per dense element, and the run stays within fp16's rounding."""
    from helpers import PLAIN_SGD, tiny_gpt_config

    runs = {}
    for name in ("none", "fp16"):
        cfg = tiny_gpt_config(tiny_text, "parallel.dp=2", "parallel.ep=2", "model.moe_experts=4", "train.steps=4",
                              *PLAIN_SGD, f"parallel.compression={name}")
        weights = pool2.run(rank0_params, cfg, tmp_path / name)[0]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        runs[name] = (weights, step_losses(tmp_path / name), summary["comm"]["bytes_per_step_per_rank"][0])
    (w0, l0, sent0), (w1, l1, sent1) = runs["none"], runs["fp16"]
    dense = sum(v.numel() for k, v in w0.items()  # the tied head is the embedding: one tensor, sent once
                if k.rsplit(".", 1)[-1] not in ("w1", "b1", "w2", "b2") and k != "head.weight")
    assert sent0 - sent1 == pytest.approx(dense * 2, rel=1e-3), (sent0, sent1, dense)
    moved = max((w0[k] - w1[k]).abs().max().item() for k in w0)
    assert 0 < moved < 2e-3, moved
    for (a, g), (b, h) in zip(l0, l1):
        assert b == pytest.approx(a, rel=2e-3) and h == pytest.approx(g, rel=2e-3)


def sparse_run(cfg, run_dir):
    """Pool task: rank 0's weights, the gradient elements it averages (its flat buffer or tp shards), the bytes it
    sent per step and its logged compression ratios."""
    import torch.distributed as dist

    from plait.train.trainer import train

    result = train(cfg, run_dir)
    s = result.strategy
    n = s.flat_grads.numel() if hasattr(s, "flat_grads") else \
        sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in s.module.parameters())
    weights = s.full_model_state_dict()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return (weights, n, [r["comm_bytes"] for r in rows if "loss" in r], [r.get("compression_ratio") for r in rows
                                                                        if "loss" in r]) if dist.get_rank() == 0 else None


SPARSE = {"zero1": (2, ("parallel.dp=2", "parallel.zero=1", "train.micro_batch_size=4")),
          "dp2xtp2": (4, ("parallel.dp=2", "parallel.tp=2", "train.micro_batch_size=2", "model.vocab_multiple=64"))}


@pytest.mark.parametrize("name", list(SPARSE))
def test_topk_of_zero1s_flat_buffer_and_of_tp_shards_along_dp(pool2, pool4, tiny_text, tmp_path, name):
    """Top-k where no DDP bucket carries the gradient: over ZeRO-1's flat buffer (each rank keeps its segment of the
    average) and over a tensor-parallel rank's shards along dp. With every entry kept (topk_ratio = 1) it is the exact
    average: one process's trajectory under plain SGD. With 5 % kept each step's all-gather sends (dp - 1) x 2k x 4
    bytes, k = ceil(0.05 n), what the logged compression ratio says against the plain all-reduce."""
    import math

    from helpers import PLAIN_SGD, max_diff, params_after, tiny_gpt_config

    world, layout = SPARSE[name]
    pool = pool4 if world == 4 else pool2
    base = [*PLAIN_SGD, "train.steps=4", "log.every=1", "model.vocab_multiple=64"]
    one = params_after(tiny_gpt_config(tiny_text, "parallel.dp=1", *base), tmp_path / "one")
    every = pool.run(sparse_run, tiny_gpt_config(tiny_text, *layout, *base, "parallel.compression='topk'",
                                                 "parallel.topk_ratio=1.0"), tmp_path / "all")[0]
    assert max_diff(one, every[0]) < 1e-5
    for (a, g), (b, h) in zip(step_losses(tmp_path / "one"), step_losses(tmp_path / "all"), strict=True):
        assert b == pytest.approx(a, rel=1e-5) and h == pytest.approx(g, rel=1e-5)
    _, n, sent, ratio = pool.run(sparse_run, tiny_gpt_config(tiny_text, *layout, *base, "parallel.compression='topk'",
                                                             "parallel.topk_ratio=0.05"), tmp_path / "sparse")[0]
    k = math.ceil(0.05 * n)
    gather = (2 - 1) * 2 * k * 4  # every rank's k (value, index) pairs
    # what the plain exchange would send: ZeRO-1's reduce-scatter, dp x tp's all-reduce of the shards
    plain = (1 if name == "zero1" else 2) * (2 - 1) / 2 * 4 * n
    params = (2 - 1) / 2 * 4 * n if name == "zero1" else 0  # ZeRO-1's all-gather of the updated parameters
    assert [r * b for r, b in zip(ratio[1:], sent[1:])] == pytest.approx([plain] * 3, rel=1e-6)
    assert all(0 <= b - gather - params < 100 for b in sent[1:])  # the rest: the logged loss and norm's collectives


@pytest.mark.parametrize("scheme", ["topk", "powersgd"])
def test_topk_and_powersgd_of_the_dense_part_under_expert_parallel(pool2, tiny_text, tmp_path, scheme):
    """dp2 x ep2: DDP's hook runs any scheme on the dense part. Top-k keeping every entry is the exact average: the
    uncompressed ep2 run's trajectory; PowerSGD (rank 1, from its third step) saves more than half of the dense
    all-reduce's bytes (the experts' token all-to-alls move alike in both runs), on losses within 10 % of the plain run's."""
    from helpers import PLAIN_SGD, max_diff, tiny_gpt_config

    base = ["parallel.dp=2", "parallel.ep=2", "model.moe_experts=4", "train.steps=4", "log.every=1", *PLAIN_SGD]
    more = ["parallel.topk_ratio=1.0"] if scheme == "topk" else ["parallel.powersgd_rank=1"]
    got = pool2.run(sparse_run, tiny_gpt_config(tiny_text, *base, f"parallel.compression='{scheme}'", *more),
                    tmp_path / scheme)[0]
    ref = pool2.run(sparse_run, tiny_gpt_config(tiny_text, *base), tmp_path / "none")[0]
    losses = step_losses(tmp_path / scheme)
    if scheme == "topk":
        assert max_diff(ref[0], got[0]) < 1e-5
        for (a, g), (b, h) in zip(step_losses(tmp_path / "none"), losses, strict=True):
            assert b == pytest.approx(a, rel=1e-5) and h == pytest.approx(g, rel=1e-5)
    else:
        dense = [r * b for r, b in zip(got[3], got[2])]  # the uncompressed all-reduce bytes it logs per step
        # PowerSGD's first two steps are plain all-reduces (torch's start_powerSGD_iter); then it compresses
        assert got[2][:2] == ref[2][:2]
        saved = [plain - sent for plain, sent in zip(ref[2][2:], got[2][2:])]
        assert all(x > 0 for x in saved) and sum(saved) > 0.5 * sum(dense[2:]), (saved, dense)
        plain_losses = step_losses(tmp_path / "none")
        assert losses[:2] == plain_losses[:2]  # the same steps until it compresses
        assert all(b == pytest.approx(a, rel=0.1) for (a, _), (b, _) in zip(plain_losses[2:], losses[2:]))
