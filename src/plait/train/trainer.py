"""The training loop: one code path for 1 and N processes, every layout.

    result = train(cfg, run_dir)               # in each worker (or in a single process)
    result = train(cfg, run_dir, resume=True)  # continue from run_dir/checkpoints/latest

The loop knows nothing about layouts: data comes from the layout-independent
sampler, the step belongs to a Strategy (plait.parallel), checkpoints go through
DCP with the plain model's names. Rank 0 writes the run directory's files.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from plait import faults
from plait.comm import CommCounter, counting
from plait.config import Config, dump_config
from plait.data import DataBundle, build_data
from plait.data.datasets import eval_batches
from plait.data.loader import StepLoader
from plait.data.sampler import GlobalBatchSampler
from plait.models import build_model
from plait.parallel import Strategy, build_strategy
from plait.parallel.layout import Layout
from plait.runtime import Runtime, mix_seed, seed_all
from plait.train.checkpoint import Checkpointer, find_resumable, load_checkpoint
from plait.train.loss import loss_for
from plait.train.memory import ActivationMeter, grads_bytes, snapshot
from plait.train.metrics import MetricsWriter, PhaseTimer
from plait.train.optim import build_optimizer, lr_at, set_lr
from plait.train.profile import StepProfiler
from plait.train.progress import Progress
from plait.train.watchdog import STRAGGLER_FACTOR, Watchdog, stragglers


@dataclass
class TrainResult:
    summary: dict
    module: nn.Module  # the plain model, single-process parameter names
    strategy: Strategy
    runtime: Runtime


def _gather(obj, rt: Runtime) -> list:
    """Every rank's `obj`, in rank order (a list of one without a process group)."""
    if not rt.distributed:
        return [obj]
    out = [None] * rt.world_size
    dist.all_gather_object(out, obj)
    return out


def _gather_floats(value: float, rt: Runtime) -> list[float]:
    """One float from every rank, in rank order."""
    if not rt.distributed:
        return [value]
    t = torch.tensor([value], dtype=torch.float64, device=rt.device)
    out = [torch.zeros_like(t) for _ in range(rt.world_size)]
    dist.all_gather(out, t)
    return [float(x) for x in out]


def _agreed_checkpoint(run_dir: Path, rt: Runtime) -> Path | None:
    """Rank 0 picks the newest checkpoint that verifies (falling back past damaged ones); every rank loads it."""
    choice = [None]
    if rt.is_main:
        found = find_resumable(run_dir)
        choice = [str(found) if found is not None else None]
    if rt.distributed:
        dist.broadcast_object_list(choice, src=0)
    return Path(choice[0]) if choice[0] else None


def _dp_mean(value: torch.Tensor, rt: Runtime) -> float:
    """Mean of a per-rank scalar over the data-parallel axis."""
    if rt.group_size("dp") > 1:
        value = value.detach().clone()
        dist.all_reduce(value, group=rt.axis_group("dp"))
        value /= rt.group_size("dp")
    return float(value)


def evaluate(strategy: Strategy, dataset, cfg: Config, rt: Runtime, task: str) -> dict:
    """Validation loss (and accuracy) on the fixed validation set.

    Each fixed-size batch is evaluated whole on one dp rank and the per-batch figures are
    combined in float64 in batch order, so the result does not depend on the layout and a
    single process with the exported weights reproduces it.
    """
    batches = eval_batches(dataset, cfg.train.eval_samples, cfg.train.eval_batch_size)
    losses = torch.zeros(len(batches), dtype=torch.float64)
    correct = torch.zeros(len(batches), dtype=torch.float64)
    dp = rt.group_size("dp")
    r = rt.axis_rank("dp") if dp > 1 else 0
    model = strategy.model
    was_training = model.training
    model.eval()
    rounds = -(-len(batches) // dp)
    with torch.no_grad():
        for k in range(rounds):
            i = k * dp + r
            if i >= len(batches):
                # Sharded parameters are gathered collectively: every rank runs as many forwards.
                x, y = dataset.fetch(batches[0])
                strategy.eval_batch(x.to(rt.device), y.to(rt.device))
                continue
            x, y = dataset.fetch(batches[i])
            loss, right = strategy.eval_batch(x.to(rt.device), y.to(rt.device))
            losses[i], correct[i] = loss.cpu(), right.cpu()
    model.train(was_training)
    if dp > 1:
        both = torch.stack([losses, correct]).to(rt.device)
        dist.all_reduce(both, group=rt.axis_group("dp"))
        losses, correct = both.cpu()
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    out = {"val_loss": float((losses * sizes).sum() / sizes.sum())}
    if task in ("classification", "binary"):
        out["val_accuracy"] = float(correct.sum() / sizes.sum())
    return out


def generate_sample(strategy: Strategy, bundle: DataBundle, cfg: Config, rt: Runtime) -> str | None:
    """A short seeded continuation of train.sample_prompt (language models only), generated on rank 0.

    The weights are gathered into a plain single-process model first (a collective: every rank
    calls this), whatever the layout that trained them.
    """
    if bundle.tokenizer is None or cfg.train.sample_tokens <= 0:
        return None
    weights = strategy.full_model_state_dict()
    if not rt.is_main:
        return None
    module = build_model(cfg.model, bundle.spec)
    if not hasattr(module, "generate"):
        return None
    module.load_state_dict(weights)
    device = rt.device
    module.to(device)
    tok = bundle.tokenizer
    prompt = torch.tensor(tok.encode(cfg.train.sample_prompt).astype("int64"), device=device)[None]
    g = torch.Generator(device=device).manual_seed(cfg.train.seed)
    was_training = module.training
    module.eval()
    out = module.generate(prompt, cfg.train.sample_tokens, temperature=0.8, top_k=20, generator=g)
    module.train(was_training)
    return tok.decode(out[0].tolist())


def write_run_files(run_dir: Path, cfg: Config, bundle: DataBundle) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "config.toml").exists():  # the CLI writes it (an elastic worker may run a resized copy)
        (run_dir / "config.toml").write_text(dump_config(cfg))
    (run_dir / "spec.json").write_text(json.dumps(asdict(bundle.spec), indent=1))
    if bundle.tokenizer is not None:
        (run_dir / "tokenizer.json").write_text(bundle.tokenizer.to_json())


def train(cfg: Config, run_dir: str | Path | None, resume: bool = False) -> TrainResult:
    """Run (or continue) training as configured; every rank calls this."""
    rt = Layout.from_config(cfg).init_runtime(cfg.launch)
    run_dir = Path(run_dir) if run_dir is not None else None
    if rt.role != "trainer":  # parameter-server ranks other than the chief worker (plait.ps)
        from plait.ps import run_role

        return run_role(cfg, rt, run_dir, resume)
    t_begin = time.perf_counter()
    bundle = build_data(cfg.data, cfg.model)
    spec = bundle.spec
    seed_all(cfg.train.seed)
    module = build_model(cfg.model, spec).to(rt.device)
    strategy = build_strategy(module, cfg, rt, lambda m, only=None: build_optimizer(m, cfg.optim, only), loss_for(spec))

    start = 0
    if resume and run_dir is not None:
        ckpt = _agreed_checkpoint(run_dir, rt)
        if ckpt is not None:
            state = load_checkpoint(strategy, ckpt)
            strategy.precision.load_state_dict(state.get("precision", {}))
            start = int(state["step"])
            rt.print(f"resuming from {ckpt} at step {start}")
    steps = cfg.train.steps
    stop = min(steps, cfg.train.stop_after) if cfg.train.stop_after else steps
    stop = max(stop, start)

    if rt.is_main and run_dir is not None:
        write_run_files(run_dir, cfg, bundle)
    writer = MetricsWriter(run_dir / "metrics.jsonl" if (run_dir is not None and rt.is_main) else None)
    dp, dp_rank = rt.axis_size("dp"), rt.axis_rank("dp")
    n_params = sum(p.numel() for p in module.parameters())
    rt.print(
        f"plait: {cfg.model.factory or cfg.model.name} ({n_params / 1e6:.2f}M params) on {spec.name} · "
        f"{rt.world_size} process{'es' if rt.world_size > 1 else ''} (dp={dp}, {strategy.name}) · "
        f"{rt.backend or 'no process group'} on {rt.device.type} · global batch {cfg.train.global_batch_size} = "
        f"{cfg.train.micro_batch_size} x {cfg.grad_accum} accum x {dp} dp"
        + (f" · run dir {run_dir}" if run_dir is not None else "")
    )

    sampler = GlobalBatchSampler(len(bundle.train), cfg.train.global_batch_size, cfg.train.seed)
    loader = StepLoader(bundle.train, sampler, start, stop, dp_rank, dp, cfg.train.micro_batch_size,
                        cfg.data.prefetch, pin_memory=rt.device.type == "cuda")
    lm = spec.task == "lm"
    per_sample = spec.tokens_per_sample if lm else 1
    unit = "tok" if lm else "samples"
    rate_key = "tokens_per_s" if lm else "samples_per_s"
    timer = PhaseTimer(rt.device)
    progress = Progress(steps, start, cfg.log.progress and rt.is_main, unit)
    window_loss = torch.zeros((), device=rt.device)
    window_steps, window_t0 = 0, time.perf_counter()
    initial_loss = final_loss = None
    last_eval: dict = {}
    loop_t0, loop_steps = time.perf_counter(), 0

    strategy.model.train()
    step = start
    comm = CommCounter()
    meter = ActivationMeter(strategy.module)
    grads_seen = 0
    measure_at = {start + 1, stop}  # memory is measured on the session's first and last step
    window_comm = window_wait = 0.0
    flagged: dict[int, int] = {}
    faults.GROUPS["dp"] = rt.axis_group("dp")
    profiler = StepProfiler(cfg.log.profile_steps, run_dir, rt.rank, rt.device)
    watchdog = Watchdog(rt, cfg.launch.timeout_s)
    watchdog.install_sigterm()
    checkpointer = Checkpointer(run_dir, rt, cfg.checkpoint.keep, cfg.checkpoint.async_) if run_dir is not None else None
    saved_at = start
    preempted = False
    phase = "data"
    batches = iter(loader)
    try:
        with counting(comm):
            for _ in range(start, stop):
                phase = "data"
                watchdog.beat(step + 1, phase)
                profiler.begin(step + 1)
                faults.maybe_fire("step", rt.rank, step + 1)
                with timer.phase("data"):  # prepared ahead by the loader's thread: this is the wait + copy
                    faults.maybe_fire("data", rt.rank, step + 1)
                    micro = [(x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True))
                             for x, y in next(batches)]
                set_lr(strategy.optimizer, lr_at(step, cfg.optim, steps))
                if cfg.model.dropout > 0:
                    # Dropout masks derive from (seed, step, rank): exact on resume, statistical across layouts.
                    torch.manual_seed(mix_seed(cfg.train.seed, step, rt.rank))
                measuring = step + 1 in measure_at
                strategy.activation_meter = meter if measuring else None
                sent_before, wait_before = comm.bytes_sent, comm.wait_s
                phase = "forward_backward"
                watchdog.beat(step + 1, phase)
                with timer.phase("forward_backward"):
                    loss = strategy.forward_backward(micro)
                if measuring:
                    grads_seen = max(grads_seen, grads_bytes(strategy.module))
                phase = "optimizer"
                watchdog.beat(step + 1, phase)
                with timer.phase("optimizer"):
                    grad_norm = strategy.clip_grad_norm(cfg.optim.grad_clip)
                    strategy.optimizer_step()
                window_comm += comm.bytes_sent - sent_before
                window_wait += comm.wait_s - wait_before
                timer.steps += 1
                window_loss += loss
                window_steps += 1
                loop_steps += 1
                step += 1
                profiler.end(step)
                phase = "sync"
                watchdog.beat(step, phase)
                stopping = watchdog.should_stop()

                if step % cfg.log.every == 0 or step == stop or step == start + 1 or stopping:
                    mean_loss = _dp_mean(window_loss / window_steps, rt)
                    step_time = (time.perf_counter() - window_t0) / window_steps
                    if initial_loss is None and step == start + 1:
                        initial_loss = mean_loss
                    final_loss = mean_loss
                    compute = _gather_floats(step_time - window_wait / window_steps, rt)
                    slow = stragglers(compute)
                    for r in slow:
                        flagged[r] = flagged.get(r, 0) + 1
                    record = {
                        "step": step, "loss": mean_loss, "lr": strategy.optimizer.param_groups[0]["lr"],
                        rate_key: cfg.train.global_batch_size * per_sample / step_time, "step_time_s": step_time,
                        "time": timer.window(), "comm_bytes": window_comm / window_steps,
                        "comm_wait_s": window_wait / window_steps, "rank_compute_s": compute,
                    }
                    if slow:
                        record["stragglers"] = slow
                    if grad_norm is not None:
                        record["grad_norm"] = float(grad_norm)
                    if hasattr(strategy, "step_metrics"):  # compression ratio, staleness, consensus distance
                        record.update(strategy.step_metrics(record))
                    writer.write(record)
                    progress.update(step, mean_loss, record[rate_key], force_line=True)
                    window_loss.zero_()
                    window_steps, window_t0, window_comm, window_wait = 0, time.perf_counter(), 0.0, 0.0
                else:
                    progress.update(step, None, None)

                ckpt_due = checkpointer is not None and (
                    step == stop or stopping or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0))
                if ckpt_due:
                    phase = "checkpoint"
                    watchdog.beat(step, phase)
                    stall = checkpointer.save(strategy, step, {"precision": strategy.precision.state_dict()})
                    saved_at = step
                    writer.write({"step": step, "checkpoint_stall_s": stall, "checkpoint_async": cfg.checkpoint.async_})
                    window_t0 += stall  # a checkpoint's stall is not step time
                if stopping:
                    preempted = True
                    break
                if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != stop:
                    phase = "eval"
                    last_eval = evaluate(strategy, bundle.val, cfg, rt, spec.task)
                    writer.write({"step": step, **last_eval})
            if checkpointer is not None:
                checkpointer.finish()
    except Exception as e:
        explained = watchdog.explain(e, step if phase in ("sync", "checkpoint", "eval") else step + 1, phase)
        if explained is e:
            raise
        raise explained from None
    finally:
        batches.close()
        progress.close()
        watchdog.restore_sigterm()
    if preempted:
        writer.close()
        rt.print(f"stopped by SIGTERM after step {step}: checkpoint {saved_at} written; continue with "
                 f"plait train --resume {run_dir}")
        summary = {"steps": step, "preempted": True, "resumed_from_step": start if start else None}
        if rt.is_main and run_dir is not None:
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return TrainResult(summary, strategy.module, strategy, rt)
    loop_time = time.perf_counter() - loop_t0

    strategy.activation_meter = None
    memory = snapshot(strategy.module, strategy.optimizer, grads_seen, meter.peak, rt.device)
    comm_per_step = comm.bytes_sent / loop_steps if loop_steps else 0.0
    per_rank = _gather([memory, comm_per_step], rt)

    final_eval = evaluate(strategy, bundle.val, cfg, rt, spec.task)
    writer.write({"step": step, **final_eval})
    sample = generate_sample(strategy, bundle, cfg, rt)
    pipeline = _gather(strategy.report(), rt) if hasattr(strategy, "report") else None

    summary = {
        "steps": step,
        "resumed_from_step": start if start else None,
        "initial_loss": initial_loss,
        "final_loss": final_loss,
        **final_eval,
        "world_size": rt.world_size,
        "parallel": {"dp": cfg.parallel.dp, "tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "strategy": strategy.name},
        "global_batch_size": cfg.train.global_batch_size,
        "micro_batch_size": cfg.train.micro_batch_size,
        "grad_accum": cfg.grad_accum,
        "precision": cfg.precision.dtype,
        "device": rt.device.type,
        "backend": rt.backend,
        "params": n_params,
        "wall_time_s": time.perf_counter() - t_begin,
        "train_time_s": loop_time,
        rate_key: (loop_steps * cfg.train.global_batch_size * per_sample / loop_time) if loop_steps else None,
    }
    summary["memory"] = {"per_rank": [m for m, _ in per_rank]}
    summary["stragglers"] = {"flagged_windows_per_rank": {str(r): n for r, n in sorted(flagged.items())},
                             "factor": STRAGGLER_FACTOR}
    summary["comm"] = {"bytes_per_step_per_rank": [c for _, c in per_rank]}
    if lm:
        summary["unigram_val_loss"] = bundle.unigram_val_loss
    if bundle.ground_truth_val_loss is not None:
        summary["ground_truth_val_loss"] = bundle.ground_truth_val_loss
    if sample is not None:
        summary["sample"] = sample
    if pipeline is not None:
        summary["pipeline"] = pipeline_summary(pipeline, cfg)
    writer.close()
    if rt.is_main:
        if pipeline is not None and run_dir is not None:
            from plait.report.pipeline import plot_timeline

            plot_timeline(pipeline, summary["pipeline"], run_dir / "pipeline.png")
        _finish(run_dir, summary, cfg, rt)
    return TrainResult(summary, strategy.module, strategy, rt)


def pipeline_summary(per_rank: list[dict], cfg: Config) -> dict:
    """Measured bubble (mean over the pipeline's ranks) next to the theory, and in-flight micro-batches per stage."""
    from plait.parallel import microbatches
    from plait.parallel.pipeline import theoretical_bubble

    p, m, v = cfg.parallel.pp, microbatches(cfg), cfg.parallel.virtual_stages
    first_group: dict[int, dict] = {}  # one pipeline: the first rank (in rank order) of each pp rank
    for r in per_rank:
        first_group.setdefault(r["pp_rank"], r)
    first_group = [first_group[k] for k in sorted(first_group)]
    return {
        "schedule": cfg.parallel.pp_schedule, "stages": p * v, "microbatches": m,
        "bubble_fraction": sum(r["bubble_fraction"] for r in first_group) / len(first_group),
        "bubble_fraction_theory": theoretical_bubble(p, m, v),
        "peak_inflight_per_rank": [r["peak_inflight"] for r in first_group],
    }


def _finish(run_dir: Path | None, summary: dict, cfg: Config, rt: Runtime) -> None:
    if run_dir is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if cfg.log.report:
            from plait.report import write_report

            write_report(run_dir)
    rate = summary.get("tokens_per_s") or summary.get("samples_per_s")
    unit = "tok/s" if "tokens_per_s" in summary else "samples/s"
    lines = [f"done: {summary['steps']} steps in {summary['wall_time_s']:.1f}s"
             + (f" ({rate:,.0f} {unit})" if rate else "")]
    line = f"val loss {summary['val_loss']:.4f}"
    if summary.get("unigram_val_loss") is not None:
        line += f" (unigram baseline {summary['unigram_val_loss']:.4f})"
    if summary.get("ground_truth_val_loss") is not None:
        line += f" (the generating model's own: {summary['ground_truth_val_loss']:.4f})"
    if "val_accuracy" in summary:
        line += f", val accuracy {summary['val_accuracy']:.3f}"
    lines.append(line)
    if summary.get("sample"):
        lines.append("sample:\n" + summary["sample"])
    if run_dir is not None:
        lines.append(f"run dir: {run_dir}" + (" (report.html)" if cfg.log.report else ""))
    rt.print("\n".join(lines))
