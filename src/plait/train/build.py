"""Building a training job, in order: runtime -> data -> model -> weights -> fine-tuning -> distillation -> strategy
-> the loop's parts (callbacks, resume, checkpointer, loader, telemetry).

    job = build_job(cfg, run_dir, resume)     # a Job for plait.train.loop.run, or a Served summary (a server rank)

Each step is a function of what the steps before it made; every scheme matter (how the model is built for
shard-only initialisation, what wraps the optimizer, which callbacks a scheme brings, what a parameter
server's ranks do) is asked of plait.parallel, so nothing here reads a scheme's keys or a rank's role.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from plait.callback import Callbacks
from plait.config import Config
from plait.data import build_data
from plait.data.augment import augmented, two_views
from plait.data.chat import trim_padding, trims_padding
from plait.data.curriculum import CurriculumSampler, length_scores, scores_from_file
from plait.data.episodes import episodic
from plait.data.loader import StepLoader
from plait.data.mix import mixed
from plait.data.sampler import make_sampler
from plait.data.stream import StreamSampler, stream_bundle
from plait.data.user import import_object
from plait.errors import ConfigError
from plait.finetune import apply_finetune
from plait.models import build_model
from plait.models.ensemble import Ensemble, ensemble_loss
from plait.models.hf import is_hf_dir
from plait.parallel import SCHEMES, Build, Layout, Precision, Strategy, build_strategy
from plait.parallel.saved import codec_for
from plait.parallel.schemes import build_module, serve_rank
from plait.runtime import Runtime, seed_all
from plait.train.checkpoint import Checkpointer, find_resumable, load_checkpoint, read_trainer_state
from plait.train.distill import Distiller
from plait.train.features import callbacks_for
from plait.train.job import check_job, metric_name
from plait.train.keys import PREFERENCE_OBJECTIVES
from plait.train.loss import TokenMeanLoss, focal_loss, loss_for, with_extra_loss
from plait.train.optim import build_optimizer
from plait.train.preference import PreferenceLoss, preference_loss
from plait.train.telemetry import Telemetry
from plait.train.weights import checkpoint_parts, init_from, load_run_model


@dataclass
class Job:
    """What the loop runs: the strategy, its callbacks, the checkpointer and telemetry, and the steps to take."""

    cfg: Config
    rt: Runtime
    layout: Layout
    strategy: Strategy
    callbacks: Callbacks
    telemetry: Telemetry
    checkpointer: Checkpointer | None  # None: this rank writes no checkpoints (no run dir, a parameter server's worker)
    loader: StepLoader
    start: int  # steps done before this session
    stop: int  # the step this session ends after

    def to_device(self, micro: list) -> list:
        device = self.rt.device
        fmt = torch.channels_last if self.cfg.train.channels_last else torch.preserve_format
        return [(x.to(device, non_blocking=True, memory_format=fmt) if x.dim() == 4 else
                 x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in micro]

    def checkpoint_due(self, step: int) -> bool:
        every = self.cfg.checkpoint.every
        return step == self.stop or bool(every and step % every == 0)

    def evaluation_due(self, step: int) -> bool:
        """Every train.eval_every steps, but the run's last (its final evaluation follows): a session that ends
        earlier (train.stop_after) evaluates at its last step as an uninterrupted run would there."""
        t = self.cfg.train
        return bool(t.eval_every and step % t.eval_every == 0 and step != t.steps and self.strategy.evaluates)

    def save(self, step: int) -> None:
        if self.checkpointer is not None:
            self.telemetry.checkpoint(step, self.checkpointer, {"callbacks": self.callbacks.state_dict()})


@dataclass
class Served:
    """A rank that holds state for the others and does not train (a parameter server): its summary."""

    summary: dict
    runtime: Runtime


def build_job(cfg: Config, run_dir: str | Path | None = None, resume: bool = False, checked: bool = False) -> Job | Served:
    """Every part of a training session on this rank, in order; every rank calls this.

    checked: the launcher checked this config whole (plait.rundir), so only the layout's arithmetic is redone."""
    # build_data below reads (and checks) a user's data once
    layout = Layout.from_config(cfg) if checked else check_job(cfg, user_data=False)
    rt = layout.init_runtime(cfg.launch)
    run_dir = Path(run_dir) if run_dir is not None else None
    bundle = data_bundle(cfg)
    model, meta_init = model_for(cfg, layout, rt, bundle.spec)
    if cfg.train.channels_last:
        model = to_channels_last(model, cfg.model.name)
    loss_fn = loss_of(cfg, model, bundle, rt)
    b = Build(cfg, rt, layout, model, lambda m, only=None: build_optimizer(m, cfg.optim, only),
              with_extra_loss(loss_fn, model), Precision(cfg.precision.dtype, rt.device), SCHEMES, meta_init, run_dir)
    served = serve_rank(b)
    if served is not None:
        return Served(served, rt)
    strategy = build_strategy(b)
    strategy.saved_codec = codec_for(cfg.train.activation_compression)
    strategy.eval_metrics = ({metric_name(r): import_object("train.eval_metrics", r) for r in cfg.train.eval_metrics}
                             | (loss_fn.eval_metrics() if isinstance(loss_fn, PreferenceLoss) else {})) or None
    callbacks = Callbacks(callbacks_for(cfg, b, strategy, bundle, loss_fn))
    start = resume_from(strategy, run_dir, rt, callbacks) if resume and run_dir is not None else 0
    t = cfg.train
    stop = max(start, min(t.steps, t.stop_after) if t.stop_after else t.steps)
    files = run_dir is not None and strategy.evaluates
    ckpt = Checkpointer(run_dir, rt, cfg.checkpoint.keep, cfg.checkpoint.async_) if files and run_dir else None
    slices = next((c.batch_slices for c in callbacks.items if c.batch_slices is not None), None)
    sampler = sampler_for(cfg, bundle, loss_fn)
    if isinstance(loss_fn, TokenMeanLoss):  # each step's trained tokens per row, from the global batch's indices
        loss_fn.order = sampler.global_batch
    loader = StepLoader(bundle.train, sampler, start,
                        stop, rt.axis_rank("batch"), layout.dp, t.micro_batch_size, cfg.data.prefetch,
                        pin_memory=rt.device.type == "cuda", workers=cfg.data.workers, slices=slices,
                        transform=batch_transform(b, bundle.spec))
    tel = Telemetry(cfg, rt, layout, run_dir, bundle, strategy, start, stop)
    tel.fields = callbacks.fields
    return Job(cfg, rt, layout, strategy, callbacks, tel, ckpt, loader, start, stop)


def batch_transform(b: Build, spec) -> Callable | None:
    """What the schemes do to a micro-batch, after chat rows are cut to their last trained target where shapes may vary."""
    schemes = b.batch_transform()
    if not trims_padding(spec, b.layout, b.cfg.train.compile):
        return schemes
    return trim_padding if schemes is None else lambda batch: schemes(trim_padding(batch))


def data_bundle(cfg: Config):
    """The configured data (two augmented views of each sample for a contrastive objective; data.augment applied)."""
    bundle = stream_bundle(cfg.data, cfg.model, build_data) if cfg.data.stream else build_data(cfg.data, cfg.model)
    if cfg.train.objective == "meta":  # N-way K-shot episodes; augmentation and mixing are refused with it (check_job)
        t = cfg.train
        return episodic(bundle, cfg.data, t.seed, {"algorithm": t.meta_algorithm, "inner_steps": t.inner_steps,
                                                   "inner_lr": t.inner_lr})
    if cfg.train.objective == "contrastive":
        bundle = two_views(bundle, cfg.data, cfg.train.seed)
    bundle = augmented(bundle, cfg.data, cfg.train.seed)  # images, seeded per (seed, index, epoch)
    return mixed(bundle, cfg.data, cfg.train.seed)  # mixup / cutmix: after the augmentation, seeded the same way


def model_for(cfg: Config, layout: Layout, rt: Runtime, spec) -> tuple[nn.Module, object]:
    """The plain model with the same initial weights on every rank, its starting weights and fine-tuning applied;
    with what fills it when the layout builds it on the meta device: the initialisation record, or the parts of
    train.init_from each rank reads its own slices from (a Hugging Face directory or a safetensors file)."""
    ft, source = cfg.finetune, cfg.train.init_from
    parts_later = bool(source) and (is_hf_dir(source) or Path(source).is_file())  # readable in parts
    # the contrastive head, and a preference objective's reference pass, read the whole model before a scheme shards it
    reads_whole = bool((source and not parts_later) or cfg.distill.teacher or ft.lora_rank or ft.adapters
                       or cfg.train.objective not in ("supervised", "meta") or cfg.model.ensemble > 1)
    seed = cfg.train.seed if cfg.train.init_seed < 0 else cfg.train.init_seed
    seed_all(seed)
    model, meta_init = build_module(layout, cfg, reads_whole, lambda: build_model(cfg.model, spec),
                                    rt.device, log=rt.print, reseed=lambda: seed_all(seed))
    if source and meta_init is not None:  # each rank reads its shards once the scheme has cut the model
        meta_init = checkpoint_parts(source, model)
    elif source:  # before any scheme wraps the model: every layout starts from the same weights
        init_from(model, source)
    apply_finetune(model, ft)  # freezing and LoRA adapters, on the plain model's names
    return model, meta_init


def sampler_for(cfg: Config, bundle, loss_fn):
    """The training order: data.sampler's, or data.curriculum's over the samples' scores."""
    c, t = cfg.data.curriculum, cfg.train
    if cfg.data.stream:  # task by task, with replay (plait.data.stream)
        return StreamSampler([len(tr) for tr, _ in bundle.tasks], t.global_batch_size, t.seed, t.steps,
                             cfg.data.replay)
    if not c:
        return make_sampler(bundle.train, t.global_batch_size, t.seed, cfg.data.sampler)
    score = c["score"]
    if score == "length":
        scores = length_scores(bundle.train)
    elif score == "loss":
        scores = loss_scores(c.get("model") or t.init_from, bundle.train, loss_fn)
    else:
        scores = scores_from_file(score, len(bundle.train))
    return CurriculumSampler(scores, t.global_batch_size, t.seed, t.steps, c.get("start", 0.2), c.get("full_at", 0.5),
                             c.get("pacing", "linear"))


@torch.no_grad()
def loss_scores(run_dir: str, dataset, loss_fn, batch: int = 64) -> torch.Tensor:
    """Each training sample's loss under a trained run's model (data.curriculum.score = 'loss'), on the CPU: every
    rank computes the same scores."""
    if not (Path(run_dir) / "config.toml").is_file():
        raise ConfigError(f"data.curriculum.score = 'loss' scores by a run's model; {run_dir} is not a run directory "
                          "(set data.curriculum.model to the --out of a training run)")
    _, _, model = load_run_model(run_dir)
    model.eval()
    out = []
    for lo in range(0, len(dataset), batch):
        x, y = dataset.fetch(torch.arange(lo, min(lo + batch, len(dataset))))
        logits = model(x)
        out += [float(loss_fn(logits[i:i + 1], y[i:i + 1])) for i in range(len(y))]
    return torch.tensor(out, dtype=torch.float64)


def to_channels_last(model: nn.Module, name: str) -> nn.Module:
    """train.channels_last: the model's 4-D weights in NHWC (image batches follow in Job.to_device)."""
    if not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        raise ConfigError(f"train.channels_last = true needs a convolutional model; model.name = {name!r} has no 2-D "
                          "convolution: set train.channels_last = false")
    return model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch accepts it; its stubs do not


def loss_of(cfg: Config, model: nn.Module, bundle, rt: Runtime):
    """train.loss, or the data's task loss; under distillation, its mix with the teacher's soft targets; a preference
    objective's, once the reference log-probabilities are in the data."""
    spec = bundle.spec
    if cfg.train.objective in PREFERENCE_OBJECTIVES:
        return preference_loss(cfg, model, bundle, rt)
    if cfg.train.loss == "focal":
        if spec.task not in ("classification", "lm") or spec.class_weights or spec.masked_targets:
            raise ConfigError(f"train.loss = 'focal' is for classification and language models without class weights "
                              f"or masked targets; this data's task is {spec.task!r}: set train.loss=''")
        loss_fn = focal_loss(cfg.train.focal_gamma)
    else:
        loss_fn = (import_object("train.loss", cfg.train.loss) if cfg.train.loss
                   else loss_for(spec, cfg.train.temperature, rt.axis_group("dp")))
    if cfg.train.loss_normalization == "tokens":  # chat data (the job check): every trained token weighs the same
        loss_fn = TokenMeanLoss((bundle.train.y != -100).sum(1))
    if isinstance(model, Ensemble):  # each member's gradient is its own loss's
        loss_fn = ensemble_loss(loss_fn, model)
    if cfg.distill.teacher:
        distiller = Distiller.from_run(cfg.distill, spec, rt.device)
        distiller.attach(model)
        loss_fn = distiller.loss(loss_fn)
    return loss_fn


def resume_from(strategy: Strategy, run_dir: Path, rt: Runtime, callbacks: Callbacks) -> int:
    """Rank 0 picks the newest checkpoint that verifies (falling back past damaged ones); every rank loads it, the
    callbacks' state with it. Returns its step (0: none to resume)."""
    choice: list[str | None] = [None]
    if rt.is_main or not rt.distributed:
        found = find_resumable(run_dir, log=print if rt.is_main else (lambda *_: None))
        choice = [str(found) if found is not None else None]
    if rt.distributed:
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return 0
    callbacks.on_resume(int(read_trainer_state(Path(choice[0]))["step"]))
    state = load_checkpoint(strategy, Path(choice[0]))
    strategy.precision.load_state_dict(state.get("precision", {}))
    callbacks.load_state_dict(state.get("callbacks", {}))
    rt.print(f"resuming from {choice[0]} at step {int(state['step'])}")
    return int(state["step"])


__all__ = ["Job", "Served", "build_job"]
