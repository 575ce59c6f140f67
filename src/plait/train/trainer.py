"""The training loop: one code path for 1 and N processes, every layout, every role that trains.

    result = train(cfg, run_dir)               # in each worker (or in a single process)
    result = train(cfg, run_dir, resume=True)  # continue from run_dir/checkpoints/latest

The loop knows nothing about layouts: data comes from the layout-independent sampler, the step
belongs to a Strategy (plait.parallel), checkpoints go through DCP with the plain model's names,
and everything the run measures about itself is plait.train.telemetry's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from plait.config import Config
from plait.data import build_data
from plait.data.augment import augmented, two_views
from plait.data.loader import StepLoader
from plait.data.sampler import make_sampler
from plait.data.user import import_object
from plait.faults import slow_compute
from plait.finetune import apply_finetune
from plait.models import build_model
from plait.models.meta import build_on_meta
from plait.parallel import SCHEMES, Build, Precision, Strategy, build_strategy, step_owner
from plait.parallel.fsdp import shard_init
from plait.parallel.hetero import HeteroShares
from plait.parallel.hetero import parse as parse_hetero
from plait.parallel.offload import offload_dir, offload_optimizer
from plait.runtime import Runtime, mix_seed, seed_all
from plait.train.callbacks import Best, EarlyStop
from plait.train.checkpoint import Checkpointer, find_resumable, load_checkpoint, read_trainer_state
from plait.train.distill import Distiller
from plait.train.job import check_job, metric_name
from plait.train.loss import loss_for, with_extra_loss
from plait.train.optim import build_optimizer, lr_at, set_lr
from plait.train.progressive import Freezer
from plait.train.telemetry import Telemetry
from plait.train.weights import init_from


@dataclass
class TrainResult:
    summary: dict
    module: nn.Module | None  # the plain model, single-process parameter names (None on a parameter server)
    strategy: Strategy | None
    runtime: Runtime


def train(cfg: Config, run_dir: str | Path | None = None, resume: bool = False) -> TrainResult:
    """Run (or continue) training as configured; every rank calls this."""
    layout = check_job(cfg, user_data=False)  # build_data below reads (and checks) a user's data once
    rt = layout.init_runtime(cfg.launch)
    run_dir = Path(run_dir) if run_dir is not None else None
    bundle = build_data(cfg.data, cfg.model)
    if cfg.train.objective == "contrastive":
        bundle = two_views(bundle, cfg.data, cfg.train.seed)
    bundle = augmented(bundle, cfg.data, cfg.train.seed)  # data.augment: images, seeded per (seed, index, epoch)
    seed_all(cfg.train.seed)  # the same initial parameters on every rank
    meta_init = None
    if shard_init(cfg):  # ZeRO-3: built on the meta device; FSDP's build materialises this rank's shards only
        model, meta_init = build_on_meta(lambda: build_model(cfg.model, bundle.spec))
        if not meta_init.supported:
            rt.print(f"note: parallel.shard_init: {meta_init.unsupported}; every rank builds the whole model")
            meta_init = None
            seed_all(cfg.train.seed)
    if meta_init is None:
        model = build_model(cfg.model, bundle.spec).to(rt.device)
    if cfg.train.init_from:  # before any scheme wraps the model: every layout starts from the same weights
        init_from(model, cfg.train.init_from)
    apply_finetune(model, cfg.finetune)  # freezing and LoRA adapters, on the plain model's names
    loss_fn = (import_object("train.loss", cfg.train.loss) if cfg.train.loss
               else loss_for(bundle.spec, cfg.train.temperature, rt.axis_group("dp")))
    if cfg.distill.teacher:
        distiller = Distiller.from_run(cfg.distill, bundle.spec, rt.device)
        distiller.attach(model)
        loss_fn = distiller.loss(loss_fn)
    off = offload_dir(run_dir, rt.rank)  # parallel.offload = disk / optimizer: state out of device memory

    def make_optimizer(m, only=None):
        return offload_optimizer(build_optimizer(m, cfg.optim, only), cfg.parallel.offload, rt.device, off,
                                 log=rt.print)

    b = Build(cfg, rt, layout, model, make_optimizer,
              with_extra_loss(loss_fn, model),
              Precision(cfg.precision.dtype, rt.device), SCHEMES, meta_init)
    if rt.role == "server":  # a parameter server holds state for the workers; it does not train
        return TrainResult(step_owner(cfg).serve(b, run_dir), None, None, rt)
    strategy = build_strategy(b)
    strategy.eval_metrics = {metric_name(r): import_object("train.eval_metrics", r) for r in cfg.train.eval_metrics} or None
    freezer = Freezer.build(cfg, strategy, rt)  # finetune.progressive_freeze (a resume freezes what its step has frozen)
    start = _resume(strategy, run_dir, rt, freezer) if resume and run_dir is not None else 0
    t = cfg.train
    stop = max(start, min(t.steps, t.stop_after) if t.stop_after else t.steps)
    files = run_dir is not None and rt.role != "worker"  # a parameter server's other workers write nothing
    ckpt = Checkpointer(run_dir, rt, cfg.checkpoint.keep, cfg.checkpoint.async_) if files else None
    sampler = make_sampler(bundle.train, t.global_batch_size, t.seed, cfg.data.sampler)
    hetero = (HeteroShares(parse_hetero(cfg.parallel.hetero, layout.dp), layout.dp, t.global_batch_size,
                           cfg.parallel.hetero_every, rt.axis_group("dp"), start) if cfg.parallel.hetero else None)
    loader = StepLoader(bundle.train, sampler, start, stop, rt.axis_rank("dp"), layout.dp, t.micro_batch_size,
                        cfg.data.prefetch, pin_memory=rt.device.type == "cuda", workers=cfg.data.workers,
                        slices=hetero.offsets if hetero else None)
    tel = Telemetry(cfg, rt, layout, run_dir, bundle, strategy, start, stop)
    if hetero is not None:
        tel.fields.append(hetero.fields)
    if freezer is not None:
        tel.fields.append(freezer.fields)
        freezer.update(start)  # what is due by `start`, frozen now
    step, saved_at, stopping = start, start, False
    best = Best(cfg.checkpoint.keep_best) if cfg.checkpoint.keep_best else None
    early = EarlyStop.from_config(t.early_stop)
    strategy.model.train()
    batches = iter(loader)
    try:
        with tel:
            if freezer is not None:  # blocks frozen before this session's first step that no earlier session wrote
                tel.note([e for e in freezer.events if e["step"] >= start])
            while step < stop:
                if freezer is not None and step > start:
                    with tel.between_steps():
                        tel.note(freezer.update(step))
                tel.begin(step + 1)
                with tel.phase("data"):  # prepared ahead by the loader's thread: this is the wait + copy
                    micro = [(x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True))
                             for x, y in next(batches)]
                set_lr(strategy.optimizer, lr_at(step, cfg.optim, t.steps, t.global_batch_size))
                if cfg.model.dropout > 0:
                    # Dropout masks derive from (seed, step, rank): exact on resume, statistical across layouts.
                    torch.manual_seed(mix_seed(t.seed, step, rt.rank))
                with tel.phase("forward_backward"):
                    t0, cpu0, waited = time.perf_counter(), time.thread_time(), tel.comm.wait_s
                    loss = strategy.forward_backward(micro)
                    # Compute alone, what a slow-device fault scales and what hetero measures. On CPU: this thread's
                    # CPU time (waiting for a collective takes none; the wall time less the collectives' issue-to-
                    # completion times would also take out backward compute that overlapped them). On an accelerator:
                    # the wall time less those waits.
                    compute = (time.thread_time() - cpu0 if rt.device.type == "cpu"
                               else time.perf_counter() - t0 - (tel.comm.wait_s - waited))
                    slept = slow_compute(rt.rank, compute)
                    if hetero is not None:
                        hetero.add(compute + slept, sum(len(x) for x, _ in micro))
                with tel.phase("optimizer"):
                    grad_norm = strategy.clip_grad_norm(cfg.optim.grad_clip, need_norm=tel.logs(step + 1))
                    strategy.optimizer_step()
                step += 1
                if hetero is not None:
                    tel.note(hetero.after_step(step, rt.device))  # auto: re-measured, re-split every hetero_every steps
                stopping = tel.end(step, loss, grad_norm)
                if ckpt is not None and (step == stop or stopping or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0)):
                    tel.checkpoint(step, ckpt)
                    saved_at = step
                if stopping:
                    break
                if t.eval_every and step % t.eval_every == 0 and step != stop and rt.role != "worker":
                    metrics = tel.evaluate(step)
                    if best is not None and best.update(step, metrics) and ckpt is not None:
                        if saved_at != step:
                            tel.checkpoint(step, ckpt)
                            saved_at = step
                        ckpt.mark_best(step)
                    if early is not None and early.update(step, metrics):
                        if ckpt is not None and saved_at != step:
                            tel.checkpoint(step, ckpt)
                            saved_at = step
                        tel.early_stopped(step, early)
                        break
            if ckpt is not None:
                ckpt.finish()
    finally:
        batches.close()
    summary = tel.preempted(step, saved_at) if stopping else tel.finish(step, best)
    if best is not None and ckpt is not None and not stopping and best.step == step:
        ckpt.mark_best(step)  # the final evaluation was the best
    strategy.finish()
    return TrainResult(summary, strategy.module, strategy, rt)


def _resume(strategy: Strategy, run_dir: Path, rt: Runtime, freezer: Freezer | None = None) -> int:
    """Rank 0 picks the newest checkpoint that verifies (falling back past damaged ones); every rank loads it."""
    choice = [None]
    if rt.is_main or not rt.distributed:
        found = find_resumable(run_dir, log=print if rt.is_main else (lambda *_: None))
        choice = [str(found) if found is not None else None]
    if rt.distributed:
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return 0
    if freezer is not None:  # blocks frozen by the checkpoint's step have no optimizer state in it
        freezer.update(int(read_trainer_state(Path(choice[0]))["step"]))
    state = load_checkpoint(strategy, Path(choice[0]))
    strategy.precision.load_state_dict(state.get("precision", {}))
    rt.print(f"resuming from {choice[0]} at step {int(state['step'])}")
    return int(state["step"])
