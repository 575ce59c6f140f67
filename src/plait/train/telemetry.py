"""What a training run measures and writes about itself, kept off the step's critical path.

The loop (plait.train.trainer) calls, per step::

    tel.begin(step + 1)                      # profiler window, fault points
    with tel.phase("forward_backward"): ...  # phase times (CUDA events on GPU), the watchdog's note
    stop = tel.end(step, loss, grad_norm)    # the metrics window; on logging steps one reduction

A logging step (every log.every steps, the session's first and last) does one all-gather of
(loss, stop flag, compute seconds) from every rank: the window's mean loss, the agreement to stop
after a SIGTERM, and the straggler figures all ride on it. Other steps do no collective and no
host-device synchronisation for telemetry. At the end `finish` evaluates, gathers memory and
traffic per rank, asks the strategy for its figures (pipeline bubble and timeline), writes
summary.json and the report, and prints the result.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from plait import faults
from plait.comm.accounting import CommCounter, counting
from plait.comm.fingerprint import Fingerprinter
from plait.config import config_to_dict, dump_config
from plait.finetune.lora import nf4_storage
from plait.models.protocols import WindowMetricsModel
from plait.report.html import write_report
from plait.train.carried import carry
from plait.train.checkpoint import step_name
from plait.train.evaluate import evaluate, fewshot_from_scratch, linear_probe, multimodal_figures
from plait.train.memory import ActivationMeter, grads_bytes, snapshot
from plait.train.metrics import MetricsWriter, PhaseTimer
from plait.train.profile import StepProfiler
from plait.train.progress import Progress
from plait.train.sample import generate_sample
from plait.train.watchdog import STRAGGLER_FACTOR, Watchdog, stragglers


def _fingerprinter(cfg, rt):
    if not (cfg.launch.check_collectives and rt.distributed):
        return None
    return Fingerprinter(dist.distributed_c10d._get_default_store(), dist.get_rank())


def weights_held(module, params=None) -> int:
    """The weights module holds (params: its parameters to count, default all); QLoRA's frozen base weights are nf4
    codes (buffers, or frozen parameters under ZeRO-2/3), counted as the weights they stand for."""
    nf4 = nf4_storage(module)
    packed = sum(m.packed_weight_numel() for m in module.modules() if hasattr(m, "packed_weight_numel"))
    return sum(p.numel() for p in (module.parameters() if params is None else params) if id(p) not in nf4) + packed


def model_counts(strategy, layout, rt) -> tuple[int, int]:
    """(all, trainable) parameters of the whole model: a sharded DTensor counts its global size, and pipeline stages
    (each holding its own blocks) are summed over the pp group. Every rank calls it."""
    copies: frozenset[int] = getattr(strategy, "tied_copies", frozenset())  # a tied weight's copy on the last stage counts once
    params = [p for p in strategy.module.parameters() if id(p) not in copies]
    counts = torch.tensor([weights_held(strategy.module, params), sum(p.numel() for p in params if p.requires_grad)],
                          dtype=torch.float64)
    if rt.distributed and layout.pp > 1:
        dist.all_reduce(counts, group=rt.axis_group("pp"))
    return int(counts[0]), int(counts[1])


def tracker_params(cfg, layout_line: str, counts: tuple[int, int], world: int) -> dict[str, str]:
    """What the trackers record as the run's parameters: every resolved config key (section.key), the layout and
    the model's parameter counts, so runs filter and compare by hyperparameter."""
    flat = {f"{section}.{key}": value for section, keys in config_to_dict(cfg).items() for key, value in keys.items()}
    flat.update({"plait.layout": layout_line, "plait.world_size": world, "plait.params": counts[0],
                 "plait.trainable_params": counts[1]})
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in flat.items()}


class Telemetry:
    def __init__(self, cfg, rt, layout, run_dir: Path | None, bundle, strategy, start: int, stop: int):
        self.cfg, self.rt, self.layout, self.run_dir, self.bundle = cfg, rt, layout, run_dir, bundle
        self.strategy, self.start, self.stop = strategy, start, stop
        self.writes = rt.is_main and run_dir is not None
        self.t_begin = time.perf_counter()
        spec = bundle.spec
        self.lm = spec.task == "lm"
        self.per_sample = spec.tokens_per_sample if self.lm else 1
        self.rate_key = "tokens_per_s" if self.lm else "samples_per_s"
        self.comm = CommCounter(_fingerprinter(cfg, rt))
        self.watchdog = Watchdog(rt, cfg.launch.timeout_s, self.comm)
        self.timer = PhaseTimer(rt.device)
        self.meter = ActivationMeter(strategy.module)
        self.profiler = StepProfiler(cfg.log.profile_steps, run_dir, rt.rank, rt.device)
        self.progress = Progress(cfg.train.steps, start, cfg.log.progress and rt.is_main, "tok" if self.lm else "samples")
        if self.writes and run_dir is not None:
            write_run_files(run_dir, cfg, bundle)
        self.counts = model_counts(strategy, layout, rt)
        params = tracker_params(cfg, layout_text(layout, strategy), self.counts, rt.world_size) \
            if self.writes and cfg.log.trackers else None
        self.writer = MetricsWriter(run_dir / "metrics.jsonl" if self.writes else None, keep_through=start,
                                    trackers=cfg.log.trackers, params=params)
        self.measure_at = {start + 1, stop}  # memory is measured on the session's first and last step
        self.step = start
        self.grads_seen = 0
        self.flagged: dict[int, int] = {}
        self.initial_loss: float | None = None
        self.final_loss: float | None = None
        self.loop_steps = 0
        self._window_reset()
        self.loop_t0 = time.perf_counter()
        self._counting = counting(self.comm)
        self.evaluated: tuple[int, dict] | None = None  # the last evaluation: (step, metrics)
        # more fields for every step record: the callbacks' (e.g. frozen_blocks)
        self.fields: Callable[[], dict] | None = None

    def _window_reset(self, t0: float | None = None) -> None:
        """A new metrics window starts: its clock and the bytes and wait counted from here."""
        self.window_loss = torch.zeros((), device=self.rt.device)
        self.window_steps, self.window_t0 = 0, time.perf_counter() if t0 is None else t0
        self.window_sent0, self.window_wait0 = self.comm.bytes_sent, self.comm.wait_s

    @contextlib.contextmanager
    def _aside(self):
        """Work that is not a training step (checkpoints, evaluation): its time and traffic leave the window."""
        t0, sent, wait = time.perf_counter(), self.comm.bytes_sent, self.comm.wait_s
        try:
            yield
        finally:
            self.window_t0 += time.perf_counter() - t0
            self.window_sent0 += self.comm.bytes_sent - sent
            self.window_wait0 += self.comm.wait_s - wait

    def between_steps(self):
        """Work between two steps (blocks frozen, DDP rebuilt): left out of the step time and traffic."""
        return self._aside()

    def note(self, records: list[dict]) -> None:
        """Event records (each with its "step") for metrics.jsonl."""
        for r in records:
            self.writer.write(r)

    # ---- the loop
    def __enter__(self) -> Telemetry:
        self._announce()
        self.watchdog.__enter__()
        self._counting.__enter__()
        return self

    def _announce(self) -> None:
        cfg, rt, layout = self.cfg, self.rt, self.layout
        total, trainable = self.counts
        what = cfg.model.hf_class or cfg.model.factory or cfg.model.name  # a transformers class by its name
        counted = f"{human_count(total)} params" + (f", {human_count(trainable)} trainable" if trainable != total else "")
        loaded = f" from {cfg.train.init_from}" if cfg.train.init_from else ""
        rt.print(
            f"plait: {what} ({counted}){loaded} on {data_text(cfg, self.bundle.spec)} · "
            f"{rt.world_size} process{'es' if rt.world_size > 1 else ''} ({layout_text(layout, self.strategy)}) · "
            f"{rt.backend or 'no process group'} on {rt.device.type} · global batch {cfg.train.global_batch_size} = "
            f"{cfg.train.micro_batch_size} x {layout.grad_accum} accum x {layout.dp} dp"
            + (f" · run dir {self.run_dir}" if self.run_dir is not None else ""))

    def __exit__(self, *exc) -> None:
        self._counting.__exit__(*exc)
        self.progress.close()
        self.watchdog.__exit__(*exc)  # explains a failed collective: who did not join, where they were

    def at(self, step: int, phase: str) -> None:
        """Note where this rank is, for the heartbeat (outside the timed phases)."""
        self.watchdog.at(step, phase)

    def begin(self, step: int) -> None:
        """Step `step` (1-based) begins."""
        self.step = step
        self.watchdog.at(step, "data")
        self.profiler.begin(step)
        faults.maybe_fire("step", self.rt.rank, step, group=self.rt.axis_group("dp"))

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time one phase of the step; yields a Compute clock (what forward/backward computed, waits left out)."""
        self.watchdog.at(self.step, name)
        measuring = name == "forward_backward" and self.step in self.measure_at
        self.strategy.activation_meter = self.meter if measuring else None
        with self.timer.phase(name):
            if name == "data":
                faults.maybe_fire("data", self.rt.rank, self.step)
            yield Compute(self.rt.device, self.comm)
        if measuring:
            self.grads_seen = max(self.grads_seen, grads_bytes(self.strategy.module))

    def logs(self, step: int) -> bool:
        """Whether step `step` writes a metrics record (the same answer on every rank)."""
        return step % self.cfg.log.every == 0 or step == self.stop or step == self.start + 1

    def end(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool:
        """Account for the finished step; on logging steps write its record. Returns whether every rank is to stop."""
        self.watchdog.at(step, "sync")
        self.timer.steps += 1
        self.window_loss += loss
        self.window_steps += 1
        self.loop_steps += 1
        self.profiler.end(step)
        if not self.logs(step):
            self.progress.update(step, None, None)
            return self.watchdog.stop_requested and not self.rt.distributed
        # The next window starts now: this step's logging (its collective included) is part of the next one's time.
        now, sent, wait = time.perf_counter(), self.comm.bytes_sent, self.comm.wait_s
        n = self.window_steps
        step_time = (now - self.window_t0) / n
        comm_bytes, comm_wait = (sent - self.window_sent0) / n, (wait - self.window_wait0) / n
        mean_loss, stopping, compute = self._agree(self.window_loss / n, step_time, comm_wait)
        if self.initial_loss is None and step == self.start + 1:
            self.initial_loss = mean_loss
        self.final_loss = mean_loss
        slow = stragglers(compute)
        for r in slow:
            self.flagged[r] = self.flagged.get(r, 0) + 1
        cfg = self.cfg
        record = {
            "step": step, "loss": mean_loss, "lr": float(self.strategy.optimizer.param_groups[0]["lr"]),
            self.rate_key: cfg.train.global_batch_size * self.per_sample / step_time, "step_time_s": step_time,
            "time": self.timer.window(), "comm_bytes": comm_bytes, "comm_wait_s": comm_wait, "rank_compute_s": compute,
        }
        if slow:
            record["stragglers"] = slow
        if grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        record.update(self.strategy.step_metrics(record))
        record.update(self._model_metrics(n))
        if self.fields is not None:
            record.update(self.fields())
        self.writer.write(record)
        self.progress.update(step, mean_loss, record[self.rate_key], force_line=True)
        self._window_reset(now)
        self.window_sent0, self.window_wait0 = sent, wait
        return stopping

    def _model_metrics(self, steps: int) -> dict:
        """The model's own figures for the window (an MoE model's expert load): `module.window_metrics(reduce, ranks,
        steps)`, where reduce sums a tensor over the data-parallel ranks (one collective, on logging steps only)."""
        module = self.strategy.module
        if not isinstance(module, WindowMetricsModel):
            return {}
        group, ranks = self.rt.axis_group("dp"), self.rt.group_size("dp")

        def reduce(t: torch.Tensor) -> torch.Tensor:
            if ranks > 1:
                dist.all_reduce(t, group=group)
            return t

        return module.window_metrics(reduce, ranks, steps)

    def _agree(self, loss: torch.Tensor, step_time: float, comm_wait: float) -> tuple[float, bool, list[float]]:
        """One all-gather: the mean loss over ranks, whether any rank was asked to stop, each rank's compute time."""
        compute = step_time - comm_wait
        mine = torch.stack([loss.detach().double().reshape(()),
                            torch.tensor(float(self.watchdog.stop_requested), dtype=torch.float64, device=loss.device),
                            torch.tensor(compute, dtype=torch.float64, device=loss.device)])
        if not self.rt.distributed:
            return float(mine[0]), bool(mine[1]), [compute]
        everyone = torch.empty(self.rt.world_size * 3, dtype=torch.float64, device=mine.device)
        dist.all_gather_single(everyone, mine)
        rows = everyone.view(self.rt.world_size, 3).cpu()
        # tp and pp ranks hold their dp rank's loss: the mean over all ranks is the mean over dp.
        return float(rows[:, 0].mean()), bool(rows[:, 1].max() > 0), rows[:, 2].tolist()

    def checkpoint(self, step: int, checkpointer, state: dict | None = None) -> None:
        """Save step `step` (with `state` in its trainer state) outside the step-time window; log how long training
        stalled for it."""
        self.at(step, "checkpoint")
        with self._aside():
            stall = checkpointer.save(self.strategy, step, {"precision": self.strategy.precision.state_dict(),
                                                            **(state or {})})
        self.writer.write({"step": step, "checkpoint_stall_s": stall, "checkpoint_async": self.cfg.checkpoint.async_})

    def evaluate(self, step: int) -> dict:
        """Evaluate at `step` once (the end of a session that just evaluated reuses it); metrics.jsonl gets the record."""
        if self.evaluated is not None and self.evaluated[0] == step:
            return self.evaluated[1]
        self.watchdog.at(step, "eval")
        with self._aside():
            out = evaluate(self.strategy, self.bundle.val, self.cfg, self.rt, self.bundle.spec.task)
        self.writer.write({"step": step, **out})
        self.evaluated = (step, out)
        if step != self.stop:  # the last one is in the closing summary
            shown = [f"{k.removeprefix('val_').replace('_', ' ')} {v:.4f}" for k, v in out.items()
                     if k.startswith("val_") and isinstance(v, float)]
            if shown:
                self.progress.note(f"step {step}/{self.cfg.train.steps}: validation " + ", ".join(shown))
        return out

    # ---- the end
    def preempted(self, step: int, saved_at: int) -> dict:
        self.writer.close()
        sig = self.watchdog.stop_signal
        how = {"SIGINT": "interrupted (Ctrl-C)", "": "stopped on request"}.get(sig, f"preempted ({sig})")
        self.rt.print(f"{how}: stopped cleanly at {step_name(saved_at)}; continue with plait train --resume {self.run_dir}")
        # stop_said: that line reached the console, so plait's launcher does not say it again
        summary = {"steps": step, "preempted": True, "resumed_from_step": self.start or None, "stop_said": True}
        if self.writes:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def finish(self, step: int, callbacks=None) -> dict:
        """Final evaluation, memory and traffic per rank, the strategy's figures; summary.json, the report, a printout."""
        loop_time = time.perf_counter() - self.loop_t0
        strategy, rt, cfg = self.strategy, self.rt, self.cfg
        strategy.activation_meter = None
        memory = snapshot(strategy.module, strategy.optimizer, self.grads_seen, self.meter.peak, rt.device)
        per_rank = _gather([memory, self.comm.bytes_sent / self.loop_steps if self.loop_steps else 0.0], rt)
        evaluates = strategy.evaluates
        final_eval = self.evaluate(step) if evaluates else {}
        probe = linear_probe(strategy, self.bundle, cfg, rt) if evaluates else None
        fewshot = fewshot_from_scratch(self.bundle, cfg, rt) if evaluates else None
        multimodal = multimodal_figures(strategy, self.bundle, cfg, rt) if evaluates else None
        reports = _gather(strategy.report(), rt)
        layout = self.layout
        summary = {
            "steps": step, "resumed_from_step": self.start or None,
            "initial_loss": self.initial_loss, "final_loss": self.final_loss, **final_eval,
            "world_size": rt.world_size,
            "parallel": {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "strategy": strategy.name},
            "global_batch_size": cfg.train.global_batch_size, "micro_batch_size": cfg.train.micro_batch_size,
            "grad_accum": layout.grad_accum, "precision": cfg.precision.dtype, "device": rt.device.type,
            "backend": rt.backend, "params": weights_held(strategy.module),
            "trainable_params": sum(p.numel() for p in strategy.module.parameters() if p.requires_grad),
            "wall_time_s": time.perf_counter() - self.t_begin, "train_time_s": loop_time,
            self.rate_key: (self.loop_steps * cfg.train.global_batch_size * self.per_sample / loop_time)
            if self.loop_steps else None,
            "memory": {"per_rank": [m for m, _ in per_rank]},
            "stragglers": {"flagged_windows_per_rank": {str(r): n for r, n in sorted(self.flagged.items())},
                           "factor": STRAGGLER_FACTOR},
            "comm": {"bytes_per_step_per_rank": [c for _, c in per_rank]},
        }
        if cfg.parallel.auto_reason:
            summary["auto_layout"] = cfg.parallel.auto_reason
        if cfg.launch.device_hour_cost:  # this session's: wall time x processes
            summary["device_hours"] = summary["wall_time_s"] * rt.world_size / 3600
            summary["cost"] = summary["device_hours"] * cfg.launch.device_hour_cost
        if self.lm:
            summary["unigram_val_loss"] = self.bundle.unigram_val_loss
        if self.bundle.stats:
            summary["data"] = self.bundle.stats
        if self.bundle.ground_truth_val_loss is not None:
            summary["ground_truth_val_loss"] = self.bundle.ground_truth_val_loss
        if callbacks is not None:
            summary.update(callbacks.summary(step, final_eval))  # early stop, the best checkpoint
        if self.bundle.spec.task == "contrastive":
            local, world = cfg.train.micro_batch_size, cfg.train.global_batch_size
            summary["contrastive"] = {"linear_probe_accuracy": probe, "temperature": cfg.train.temperature,
                                      "similarity_bytes_per_rank": (2 * local) * (2 * world) * 4}
        if multimodal is not None:
            summary["multimodal"] = multimodal
        if fewshot is not None:
            summary["fewshot"] = {**fewshot, "val_accuracy": final_eval.get("val_accuracy")}
        if rt.is_main and reports[0] is not None:
            summary.update(strategy.figures(reports, self.run_dir))
        self.writer.close()
        if rt.is_main:  # the run is whole before the sample is tried: a sample that fails loses nothing
            self._write_files(summary)
        sample = self._sample() if evaluates else None
        if sample is not None:
            summary["sample"] = sample
            if rt.is_main:
                self._write_files(summary)
        if rt.is_main:
            self._print_summary(summary)
        return summary

    def _sample(self) -> str | None:
        """The end-of-run sample (plait.train.sample); one that fails is a warning, never the run's end."""
        try:
            return generate_sample(self.strategy, self.bundle, self.cfg, self.rt)
        except Exception as e:  # noqa: BLE001 -- whatever the sample meets, the run it follows is complete
            first = (str(e).strip().splitlines() or [""])[0][:300]
            self.rt.print(f"warning: the end-of-run sample failed ({type(e).__name__}: {first}); the run is complete "
                          "(summary.json and the report are written); set train.sample_tokens=0 to skip the sample")
            return None

    def _write_files(self, summary: dict) -> None:
        run_dir, cfg = self.run_dir, self.cfg
        if run_dir is not None:
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
            if cfg.log.report:
                write_report(run_dir)

    def _print_summary(self, summary: dict) -> None:
        run_dir, cfg = self.run_dir, self.cfg
        rate = summary.get(self.rate_key)
        unit = "tok/s" if self.lm else "samples/s"
        lines = [f"done: {summary['steps']} steps in {summary['wall_time_s']:.1f}s" + (f" ({rate:,.0f} {unit})" if rate else "")]
        if "val_loss" in summary:
            line = f"val loss {summary['val_loss']:.4f}"
            if summary.get("unigram_val_loss") is not None:
                line += f" (unigram baseline {summary['unigram_val_loss']:.4f})"
            if summary.get("ground_truth_val_loss") is not None:
                line += f" (the generating model's own: {summary['ground_truth_val_loss']:.4f})"
            if "val_accuracy" in summary:
                line += f", val accuracy {summary['val_accuracy']:.3f}"
            if summary.get("contrastive", {}).get("linear_probe_accuracy") is not None:
                line += f", linear-probe accuracy {summary['contrastive']['linear_probe_accuracy']:.3f}"
            if "multimodal" in summary:
                line += f", zero-shot accuracy {summary['multimodal']['zero_shot_accuracy']:.3f}"
            if "fewshot" in summary:
                line += f" on held-out classes ({summary['fewshot']['scratch_val_accuracy']:.3f} from scratch)"
            lines.append(line)
        pref = summary.get("preference", {})
        if "reward_margin" in pref:
            lines.append(f"{pref['objective']}: reward margin {pref['reward_margin']:.4f} (chosen "
                         f"{pref['reward_chosen']:.4f}, rejected {pref['reward_rejected']:.4f}), "
                         f"{pref['reward_accuracy']:.0%} of the last pairs ranked right")
        data = summary.get("data", {})
        if data.get("truncated"):
            lines.append(f"data: {data['truncated']} of {data['examples']} examples were longer than "
                         f"{data['limit_tokens']} tokens and were cut (raise model.context to keep them whole)")
        if data.get("dropped"):
            lines.append(f"data: {data['dropped']} of {data['examples']} pairs have a prompt of {data['limit_tokens']} "
                         "tokens or more and were left out (raise model.context to keep them)")
        if summary.get("sample"):
            lines.append("sample:\n" + summary["sample"])
        if run_dir is not None:
            lines.append(f"run dir: {run_dir}" + (" (report.html)" if cfg.log.report else ""))
        self.rt.print("\n".join(lines))


def _gather(obj, rt) -> list:
    """Every rank's `obj`, in rank order (a list of one without a process group)."""
    if not rt.distributed:
        return [obj]
    out = [None] * rt.world_size
    dist.all_gather_object(out, obj)
    return out


def write_run_files(run_dir: Path, cfg, bundle) -> None:
    """config.toml (unless the launcher wrote it), spec.json, the tokenizer and a Hugging Face train.init_from's own
    files (plait.train.carried)."""
    from dataclasses import asdict

    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "config.toml").exists():  # the CLI writes it (an elastic worker may run a resized copy)
        (run_dir / "config.toml").write_text(dump_config(cfg))
    (run_dir / "spec.json").write_text(json.dumps(asdict(bundle.spec), indent=1))
    if bundle.tokenizer is not None:
        (run_dir / "tokenizer.json").write_text(bundle.tokenizer.to_json())
    carry(run_dir, cfg.train.init_from)


def human_count(n: int) -> str:
    """A parameter count as people write it: 4.8K, 823K, 1.10B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}" if unit == "K" else f"{n / size:.2f}{unit}"
    return str(n)


def data_text(cfg, spec) -> str:
    """The data as the header names it: the source's name, or the user's factory by its import path."""
    if spec.name == "factory" and getattr(cfg.data, "factory", ""):
        return f"your data ({cfg.data.factory})"
    return spec.name


def layout_text(layout, strategy) -> str:
    """The layout as the header shows it: every axis larger than 1 ("one process" when none is), the strategy in the
    words users know it by (none for a lone replica, whose axes say it all), ZeRO, the strategy's labels."""
    degrees = (("dp", layout.dp), ("cp", layout.cp), ("tp", layout.tp), ("pp", layout.pp), ("ep", layout.ep))
    axes = [f"{n}={v}" for n, v in degrees if v > 1] or ["one process"]
    name = strategy.name
    words = {"single": "", "ddp": "DDP", "tp+dp": "DDP" if layout.dp > 1 else ""}.get(name, name)
    if name.startswith("zero"):  # zero1 / zero3: the ZeRO-n label below says it
        words = ""
    extra = [w for w in [words] if w] + ([f"ZeRO-{layout.zero}"] if layout.zero else []) + list(strategy.labels)
    return " ".join(axes) + (f", {', '.join(extra)}" if extra else "")


class Compute:
    """This rank's compute time since it was made: on CPU the thread's CPU time (waiting for a collective takes
    none; the wall time less the collectives' issue-to-completion times would also take out backward compute that
    overlapped them); on an accelerator the wall time less those waits."""

    def __init__(self, device, comm: CommCounter):
        self.cpu, self.comm = device.type == "cpu", comm
        self.t0, self.cpu0, self.waited = time.perf_counter(), time.thread_time(), comm.wait_s

    def seconds(self) -> float:
        if self.cpu:
            return time.thread_time() - self.cpu0
        return time.perf_counter() - self.t0 - (self.comm.wait_s - self.waited)
