"""The loops of the ranks that do not run plait's trainer under a parameter server: servers, and workers 1..dp-1.

Worker 0, the chief, runs the trainer (metrics, evaluation, checkpoints). The other workers only
compute gradients on their slices of each global batch and push them; they write no files, so
one can die without touching the run directory. A resumed run starts them at the checkpoint
the chief resumes from (the same search over RUN_DIR/checkpoints).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from plait import faults
from plait.config import Config


def _model_and_data(cfg: Config, device):
    from plait.data import build_data
    from plait.models import build_model
    from plait.runtime import seed_all

    bundle = build_data(cfg.data, cfg.model)
    seed_all(cfg.train.seed)  # the same initial parameters on every rank, servers included
    return build_model(cfg.model, bundle.spec).to(device), bundle


def run_server(cfg: Config, rt, run_dir: Path | None) -> dict:
    """Hold this server's shard until every worker is done or gone; returns its summary."""
    from plait.ps import server as srv
    from plait.ps.policy import assign_shards

    module, _ = _model_and_data(cfg, torch.device("cpu"))
    index = rt.rank - cfg.parallel.dp
    shards = assign_shards({n: p.numel() * p.element_size() for n, p in module.named_parameters()}, cfg.parallel.ps_servers)
    server = srv.ParameterServer(index, module, shards[index], cfg)
    srv.start(server)
    t0 = time.perf_counter()
    server.serve()
    time.sleep(0.2)  # let the last answers leave before the agent stops
    summary = {"role": "server", **server.report(run_dir, plot=cfg.log.report), "wall_time_s": time.perf_counter() - t0}
    if server.dead:
        print(f"ps{index}: worker(s) {sorted(server.dead)} stopped early; the others finished "
              f"({server.version} updates applied)", flush=True)
    return summary


def _resume_step(run_dir: Path | None, resume: bool) -> int:
    from plait.train.checkpoint import find_resumable, read_trainer_state

    if not (resume and run_dir is not None):
        return 0
    ckpt = find_resumable(run_dir, log=lambda *_: None)
    return int(read_trainer_state(ckpt)["step"]) if ckpt is not None else 0


def run_worker(cfg: Config, rt, run_dir: Path | None, resume: bool) -> dict:
    """Worker 1..dp-1: gradients of this worker's slices, pushed for steps [start, stop); no files."""
    from plait.data.loader import StepLoader
    from plait.data.sampler import GlobalBatchSampler
    from plait.parallel.base import Precision
    from plait.parallel.ps import build_ps_strategy
    from plait.runtime import mix_seed
    from plait.train.loss import loss_for
    from plait.train.optim import build_optimizer, lr_at, set_lr

    module, bundle = _model_and_data(cfg, rt.device)
    strategy = build_ps_strategy(module, cfg, rt, lambda m: build_optimizer(m, cfg.optim), loss_for(bundle.spec),
                                 Precision(cfg.precision.dtype, rt.device), whole_batches=False)
    start = _resume_step(run_dir, resume)
    steps = cfg.train.steps
    stop = max(start, min(steps, cfg.train.stop_after) if cfg.train.stop_after else steps)
    sampler = GlobalBatchSampler(len(bundle.train), cfg.train.global_batch_size, cfg.train.seed)
    loader = StepLoader(bundle.train, sampler, start, stop, rt.rank, cfg.parallel.dp, cfg.train.micro_batch_size,
                        cfg.data.prefetch)
    module.train()
    step = start
    for micro in loader:
        faults.maybe_fire("step", rt.rank, step + 1)
        set_lr(strategy.optimizer, lr_at(step, cfg.optim, steps))
        if cfg.model.dropout > 0:
            torch.manual_seed(mix_seed(cfg.train.seed, step, rt.rank))
        micro = [(x.to(rt.device), y.to(rt.device)) for x, y in micro]
        strategy.forward_backward(micro)
        strategy.clip_grad_norm(cfg.optim.grad_clip)
        strategy.optimizer_step()
        step += 1
    strategy.client.finish()
    return {"role": "worker", "worker": rt.rank, "steps": step, "resumed_from_step": start or None}
