"""Shared pieces of the fine-tuning tests (module-level, so the rank pool can run them)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import TINY_GPT

STEPS = 3
# Plain SGD (no momentum, weight decay, clipping or schedule): an update is exactly -lr * gradient, so a
# gradient that is wrong by a factor, or that moves a frozen parameter, shows in the loss, the norm and the weights.
SGD = ["optim.name='sgd'", "optim.lr=0.3", "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0",
       "optim.schedule='constant'", "optim.warmup_steps=0", "log.every=1", f"train.steps={STEPS}", "checkpoint.every=0"]


def gpt(corpus: Path, *more: str) -> list[str]:
    return [*TINY_GPT, "data.name='text'", f"data.path='{corpus}'", *SGD, *more]


def run_trajectory(cfg, run_dir):
    """Pool task (or in-process): train; rank 0 returns (losses, grad norms, final weights, summary)."""
    import torch.distributed as dist

    from plait.train.trainer import train

    result = train(cfg, run_dir)
    params = result.strategy.full_model_state_dict()
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows], params, result.summary


def assert_same(ref, got, tol: float = 1e-5, weights_tol: float | None = None) -> None:
    (l1, g1, p1, _), (l2, g2, p2, _) = ref, got
    assert p1.keys() == p2.keys()
    rel = lambda a, b: max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))
    w = max(float((p1[k] - p2[k]).abs().max()) for k in p1)
    assert rel(l1, l2) <= tol and rel(g1, g2) <= tol and w <= (tol if weights_tol is None else weights_tol), \
        (l1, l2, g1, g2, w)


def val_loss(model, cfg) -> float:
    """A plain model's validation loss in one process, as the trainer computes it (fixed batches, weighted by size)."""
    from plait.compress.core import val_loss as loss_of
    from plait.data import build_data

    return loss_of(model, cfg, build_data(cfg.data, cfg.model))


def load_benchmark(register_only: bool = False):
    """benchmarks/finetune.py as the module `bench_finetune`; a pool's ranks load it too, to unpickle its pool tasks."""
    import importlib.util
    import sys

    if "bench_finetune" not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "benchmarks" / "finetune.py"
        spec = importlib.util.spec_from_file_location("bench_finetune", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_finetune"] = module
        spec.loader.exec_module(module)
    return None if register_only else sys.modules["bench_finetune"]
