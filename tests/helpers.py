"""Shared test helpers: tiny configs and functions that the rank pool runs (module-level, picklable)."""

from __future__ import annotations

from pathlib import Path

import torch

from plait.config import load_config

# optim.eps = 1e-6: with AdamW's default 1e-8, gradient entries that are zero up to rounding (~1e-10)
# get updates of lr * g / (|g| + eps) ~ 1e-2 * lr whose sign is the rounding's; a larger eps keeps
# that amplified noise below the 1e-5 the layout-independence contract is checked at.
TINY_GPT = [
    "model.layers=2", "model.width=32", "model.heads=2", "model.context=32",
    "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_samples=16", "train.eval_batch_size=4",
    "train.sample_tokens=0", "optim.warmup_steps=3", "optim.lr=3e-3", "optim.eps=1e-6",
    "log.progress=false", "log.report=false", "log.every=1",
    "data.min_char_count=1", "checkpoint.every=5", "checkpoint.keep=3",
]


def tiny_gpt_config(corpus: Path, *overrides: str):
    return load_config(None, TINY_GPT + ["data.name='text'", f"data.path='{corpus}'", *overrides])


def params_after(cfg, run_dir, resume: bool = False) -> dict[str, torch.Tensor]:
    """Train as configured in this process (or on this rank); the plain model's parameters, on CPU."""
    from plait.train.trainer import train

    result = train(cfg, run_dir, resume=resume)
    return result.strategy.full_model_state_dict()


def rank0_params(cfg, run_dir, resume: bool = False):
    """Pool task: train on every rank, return rank 0's parameters (None elsewhere)."""
    import torch.distributed as dist

    params = params_after(cfg, run_dir, resume)
    return params if dist.get_rank() == 0 else None


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
