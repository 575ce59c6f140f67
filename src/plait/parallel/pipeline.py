"""Pipeline parallel with torch.distributed.pipelining: the model cut into stages by blocks, a schedule per step.

Each pp rank holds one stage (or `virtual_stages` stages for interleaved 1F1B, assigned in a
loop: rank r holds stages r, r + pp, ...). The step is the schedule: the rank's local batch is
split into `microbatches` micro-batches that stream through the stages (GPipe: all forwards,
then all backwards; 1F1B: one forward, one backward in the steady state, so at most p
micro-batches are in flight per stage). The schedule averages gradients over micro-batches, so
the gradient is the local batch's mean as in every other layout.

A weight tied across the first and last stage (GPT's embedding and head) is two copies kept
equal: their gradients are summed between the two stages before the optimizer runs, and
checkpoints name both after the canonical parameter, so any layout can resume them.

Every stage records when each micro-batch's forward and backward ran; `report()` turns that
into the measured bubble fraction, in-flight micro-batches and a timeline to plot.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from plait.comm.p2p import recv_tensor, send_tensor
from plait.errors import ConfigError
from plait.models import capabilities
from plait.models.protocols import pipeline_blocks, pipeline_parts
from plait.parallel.base import Strategy
from plait.parallel.gradsync import align_grads, allreduce_grads, clip_grad_norm
from plait.parallel.scheme import Build, Scheme
from plait.parallel.split import pipeline_stage, stage_bounds

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}


def theoretical_bubble(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """(p - 1) / (m + p - 1) for GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2021), / v interleaved."""
    return (pp - 1) / (microbatches + pp - 1) / virtual_stages


def union_module(parts: list[nn.Module], blocks_attr: str) -> nn.Module:
    """One module holding all of a rank's stages under the plain model's names (for optimizer and checkpoints)."""
    union = nn.Module()
    if blocks_attr == "":  # an nn.Sequential: its blocks are its children, named as in the plain model
        for part in parts:
            for name, child in part.named_children():
                union.add_module(name, child)
        return union
    blocks = nn.ModuleDict()
    for part in parts:
        for name, child in part.named_children():
            if name == blocks_attr:
                for k, b in child.items():
                    blocks[k] = b
            elif child is not None:
                union.add_module(name, child)
    union.add_module(blocks_attr, blocks)
    return union


class PipelineStrategy(Strategy):
    name = "pipeline"
    sharded = True

    def __init__(self, parts: list[nn.Module], stage_ids: list[int], num_stages: int, rt, make_optimizer, loss_fn,
                 precision, local_batch: int, microbatches: int, schedule: str, blocks_attr: str,
                 tied: dict[str, str], dp_sync: bool):
        self.rt = rt
        self.pp_group = rt.axis_group("pp")
        self.pp = rt.axis_size("pp")
        self.parts, self.stage_ids, self.num_stages = parts, stage_ids, num_stages
        self.microbatches, self.schedule_name = microbatches, schedule
        self.virtual = len(parts)
        union = union_module(parts, blocks_attr)
        optimizer = make_optimizer(union)
        super().__init__(nn.ModuleList(parts), union, optimizer, loss_fn, precision, local_batch)
        self.name = f"pipeline-{schedule}"
        self.dp_sync = dp_sync
        self.stages = [PipelineStage(p, s, num_stages, rt.device, group=self.pp_group) for p, s in zip(parts, stage_ids)]
        cls = SCHEDULES[schedule]
        self.schedule = cls(self.stages if schedule == "interleaved-1f1b" else self.stages[0], microbatches,
                            loss_fn=self._loss)
        self.first, self.last = 0 in stage_ids, (num_stages - 1) in stage_ids
        self._setup_tied(tied)
        self.events: list[tuple] = []
        self.step_stats: list[tuple[float, float, float, int]] = []  # (first start, last end, busy s, peak in-flight)
        self.last_timeline: list[tuple] = []
        self._last_forward = None
        for st in self.stages:
            self._instrument(st)

    # ---- the step
    def _loss(self, output, target):
        if self.activation_meter is not None:  # the loss's saved tensors belong to the micro-batch just run
            with self.activation_meter.measure(self._last_forward):
                return self.loss_fn(output, target)
        return self.loss_fn(output, target)

    def forward_backward(self, micro_batches) -> torch.Tensor:
        x = torch.cat([m[0] for m in micro_batches])
        y = torch.cat([m[1] for m in micro_batches])
        losses: list = []
        self.events = []
        t0 = time.time()  # wall clock: the timeline lines up ranks of different processes (and machines)
        with self.precision.autocast():
            self.schedule.step(*((x,) if self.first else ()), target=y if self.last else None,
                               losses=losses if self.last else None)
        span = time.time() - t0
        self._record_step(t0, span)
        align_grads(self.module.parameters())
        self._sync_tied()
        if self.dp_sync:
            allreduce_grads(self.module.parameters(), self.rt.axis_group("dp"), self.rt.axis_size("dp"))
        loss = torch.stack([loss.detach().float() for loss in losses]).mean() if losses else torch.zeros(())
        loss = loss.to(self.rt.device)
        dist.all_reduce(loss, group=self.pp_group)  # only the last stage contributes
        return loss

    def clip_grad_norm(self, max_norm: float, need_norm: bool = True):
        """Each stage holds its own parameters: squares summed over the pipeline; a tied copy is clipped, not counted."""
        self.precision.unscale(self.optimizer, self.overflow_group())
        if max_norm <= 0 and not need_norm:
            return None
        params = list(self.module.parameters())
        counted = [p for p in params if id(p) not in self._alias_ids]
        copies = [p for p in params if id(p) in self._alias_ids]
        return clip_grad_norm([], max_norm, partial=counted, group=self.pp_group, clip_also=copies)

    # ---- a weight shared by the first and last stage
    def _setup_tied(self, tied: dict[str, str]) -> None:
        """Process groups joining, for every (dp, tp) position, the ranks of the first and last stage."""
        self.tied, self._tied_group, self._alias_ids = {}, None, frozenset()
        first_rank, last_rank = 0, (self.num_stages - 1) % self.pp
        if not tied or first_rank == last_rank:
            return
        mesh = self.rt.mesh.mesh  # (pp, dp, tp) -> global rank
        me = dist.get_rank()
        for d in range(mesh.shape[1]):
            for t in range(mesh.shape[2]):
                ranks = [int(mesh[first_rank, d, t]), int(mesh[last_rank, d, t])]
                group = dist.new_group(ranks)  # every rank creates every group, in the same order
                if me in ranks:
                    self._tied_group = group
        names = dict(self.module.named_parameters(remove_duplicate=False))
        for alias, canonical in tied.items():
            param = names.get(alias) if self.last else names.get(canonical) if self.first else None
            if param is not None:
                self.tied[alias if self.last else canonical] = param
        if self.last and not self.first:
            self._alias_ids = frozenset(id(p) for n, p in self.tied.items() if n in tied)
        self._alias_names = dict(tied)

    def _sync_tied(self) -> None:
        if self._tied_group is None:
            return
        for param in self.tied.values():
            g = param.grad
            local = g.to_local() if hasattr(g, "to_local") else g
            dist.all_reduce(local, group=self._tied_group)

    # ---- checkpoints: the alias copy is saved and loaded under the canonical name
    @property
    def state_module(self) -> nn.Module:
        return self.module  # all of this rank's stages under the plain model's names

    def state_dict(self) -> dict:
        sd = super().state_dict()
        if self._alias_ids:
            state = sd["optim"]["state"]
            for alias, canonical in self._alias_names.items():
                if alias in state:
                    state[canonical] = state.pop(alias)
        return sd

    def load_state_dict(self, state: dict) -> None:
        if self._alias_ids:
            st = state["optim"]["state"]
            for alias, canonical in self._alias_names.items():
                if canonical in st:
                    st[alias] = st.pop(canonical)
        super().load_state_dict(state)

    def full_model_state_dict(self) -> dict:
        sd = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
        sd = {k: v.detach().cpu().clone() for k, v in sd.items()}
        parts: list = [None] * self.pp
        dist.all_gather_object(parts, sd, group=self.pp_group)
        out: dict = {}
        for p in parts:
            out.update(p)
        return out

    # ---- evaluation: a plain forward through the stages, activations sent point to point
    @torch.no_grad()
    def eval_batch(self, x: torch.Tensor, y: torch.Tensor):
        me = dist.get_rank(self.pp_group)
        h = x
        for s in range(self.num_stages):
            owner = s % self.pp
            if owner != me:
                continue
            prev = (s - 1) % self.pp
            if s > 0 and prev != me:
                h = recv_tensor(dist.get_global_rank(self.pp_group, prev), h.device, dtype=torch.float32)
            with self.precision.autocast():
                h = self.parts[self.stage_ids.index(s)](h)
            nxt = (s + 1) % self.pp
            if s < self.num_stages - 1 and nxt != me:
                send_tensor(h, dist.get_global_rank(self.pp_group, nxt))
        out = torch.zeros(2, dtype=torch.float64, device=x.device)
        if self.last:
            out[0] = self.loss_fn(h, y).double()
            out[1] = (h.argmax(-1) == y).sum().double() if h.dim() == 2 else 0.0
        dist.all_reduce(out, group=self.pp_group)
        return out[0], out[1]

    # ---- timeline
    def _instrument(self, stage) -> None:
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
        sid = stage.stage_index

        def forward_one_chunk(mb, *args, **kwargs):
            t = time.time()
            self._last_forward = (sid, mb, len(self.step_stats))
            meter = self.activation_meter.measure(self._last_forward) if self.activation_meter else None
            if meter:
                with meter:
                    out = fwd(mb, *args, **kwargs)
            else:
                out = fwd(mb, *args, **kwargs)
            self.events.append((sid, "F", mb, t, time.time()))
            return out

        def backward_one_chunk(mb, *args, **kwargs):
            t = time.time()
            out = bwd(mb, *args, **kwargs)
            self.events.append((sid, "B", mb, t, time.time()))
            return out

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk

    def _record_step(self, t0: float, span: float) -> None:
        busy = sum(e[4] - e[3] for e in self.events)
        inflight = peak = 0
        for _, kind, _, _, _ in sorted(self.events, key=lambda e: e[3]):
            inflight += 1 if kind == "F" else -1
            peak = max(peak, inflight)
        first = min((e[3] for e in self.events), default=t0)
        last = max((e[4] for e in self.events), default=t0 + span)
        self.step_stats.append((first, last, busy, peak))
        self.last_timeline = list(self.events)  # absolute times; the plot lines ranks up

    def figures(self, reports: list[dict], run_dir) -> dict:
        """The measured bubble next to the theory, micro-batches in flight per stage, and the timeline plot."""
        summary = pipeline_summary(reports, self.schedule_name, self.pp, self.microbatches, self.virtual)
        if run_dir is not None:
            from plait.report.pipeline import plot_timeline  # lazily: only rank 0 at the end needs matplotlib

            plot_timeline(reports, summary, run_dir / "pipeline.png")
        return {"pipeline": summary}

    def report(self) -> dict:
        """This rank's pipeline figures per step (steps after the first, which includes setup); wall-clock times."""
        stats = self.step_stats[1:] or self.step_stats
        return {
            "pp_rank": dist.get_rank(self.pp_group),
            "stages": self.stage_ids,
            "steps": [(first, last, busy) for first, last, busy, _ in stats],
            "peak_inflight": max((p for *_, p in stats), default=0),
            "timeline": self.last_timeline,
        }


def pipeline_summary(per_rank: list[dict], schedule: str, p: int, m: int, v: int) -> dict:
    """Measured bubble next to the theory, and in-flight micro-batches per stage.

    The bubble is the theory's: each step spans one pipeline from its first forward on any stage to
    its last backward on any stage, and every stage's idle share of that span counts (a stage's own
    schedule call ends before the pipeline does, so its own span would hide part of its idling).
    """
    first: dict[int, dict] = {}  # one pipeline: the first rank (in rank order) of each pp rank
    for r in per_rank:
        first.setdefault(r["pp_rank"], r)
    one = [first[k] for k in sorted(first)]
    bubbles = []
    for step in zip(*(r["steps"] for r in one)):
        span = max(last for _, last, _ in step) - min(start for start, _, _ in step)
        if span > 0:
            bubbles.append(1.0 - sum(busy for _, _, busy in step) / len(step) / span)
    return {
        "schedule": schedule, "stages": p * v, "microbatches": m,
        "bubble_fraction": sum(bubbles) / len(bubbles) if bubbles else 0.0,
        "bubble_fraction_theory": theoretical_bubble(p, m, v),
        "peak_inflight_per_rank": [r["peak_inflight"] for r in one],
    }


def microbatches(cfg) -> int:
    """Pipeline micro-batches per step: parallel.microbatches, else the accumulation count."""
    t = cfg.train
    return cfg.parallel.microbatches or t.global_batch_size // (t.micro_batch_size * cfg.parallel.dp)


def check(cfg) -> None:
    p, t = cfg.parallel, cfg.train
    if p.virtual_stages < 1:
        raise ConfigError(f"parallel.virtual_stages = {p.virtual_stages} must be >= 1")
    if p.virtual_stages > 1 and p.pp_schedule != "interleaved-1f1b":
        raise ConfigError(
            f"parallel.virtual_stages = {p.virtual_stages} needs parallel.pp_schedule = 'interleaved-1f1b' "
            f"(it is {p.pp_schedule!r})")
    if p.pp_schedule == "interleaved-1f1b" and p.pp > 1 and p.virtual_stages < 2:
        raise ConfigError("parallel.pp_schedule = 'interleaved-1f1b' needs parallel.virtual_stages >= 2 model "
                          "chunks per pipeline rank; set --set parallel.virtual_stages=2")
    if p.microbatches < 0:
        raise ConfigError(f"parallel.microbatches = {p.microbatches} must be >= 0 (0: derived)")
    if p.pp_split and p.pp > 1 and len(p.pp_split) != p.pp * p.virtual_stages - 1:
        raise ConfigError(
            f"parallel.pp_split = {p.pp_split} gives {len(p.pp_split) + 1} stages but the layout has "
            f"{p.pp * p.virtual_stages}; give {p.pp * p.virtual_stages - 1} block indices")
    if p.pp == 1:
        return
    if p.microbatches and t.global_batch_size % (p.dp * p.microbatches):
        raise ConfigError(
            f"train.global_batch_size ({t.global_batch_size}) must be divisible by parallel.dp ({p.dp}) * "
            f"parallel.microbatches ({p.microbatches}) = {p.dp * p.microbatches}")
    m = microbatches(cfg)
    if p.pp_schedule == "interleaved-1f1b" and m % p.pp:
        raise ConfigError(
            f"parallel.pp_schedule = 'interleaved-1f1b' needs the micro-batches per step ({m}) to be a multiple "
            f"of parallel.pp ({p.pp}); set parallel.microbatches={p.pp * max(1, m // p.pp)}")


def check_model(cfg, model: nn.Module | None) -> None:
    """The model can be cut into pp * virtual_stages stages (model None: the registered model cfg.model names)."""
    p = cfg.parallel
    stages = p.pp * p.virtual_stages
    if model is None:
        if "pipeline" not in capabilities(cfg.model):
            raise ConfigError(
                f"parallel.pp = {p.pp} cuts the model into stages, but model.name = {cfg.model.name!r} has no pipeline "
                "cut points (an nn.Sequential, or a `pipeline_parts()` method naming its blocks, see docs/models.md); "
                "set parallel.pp=1")
        if cfg.model.name == "gpt" and stages > cfg.model.layers:
            raise ConfigError(
                f"parallel.pp ({p.pp}) * parallel.virtual_stages ({p.virtual_stages}) = {stages} "
                f"stages but model.layers = {cfg.model.layers}: every stage needs a block; lower pp or raise layers")
        return
    what = cfg.model.factory or type(model).__name__
    blocks = pipeline_blocks(model)
    if blocks is None:
        raise ConfigError(
            f"parallel.pp = {p.pp} cuts the model into stages, but {what}"
            f"{f' ({type(model).__name__})' if cfg.model.factory else ''} is no nn.Sequential and has no "
            "`pipeline_parts()` naming its blocks (docs/models.md); set parallel.pp=1")
    if stages > len(blocks):
        raise ConfigError(
            f"parallel.pp ({p.pp}) * parallel.virtual_stages ({p.virtual_stages}) = {stages} stages but {what} has "
            f"{len(blocks)} block(s) to cut between: every stage needs one; set parallel.pp={max(1, len(blocks))} or lower")
    if p.pp_split and not all(0 < i < len(blocks) for i in p.pp_split):
        raise ConfigError(f"parallel.pp_split = {p.pp_split}: {what} has {len(blocks)} blocks; give block indices "
                          f"strictly between 0 and {len(blocks)}")


def build(b: Build) -> PipelineStrategy:
    """Cut the plain model into pp * virtual_stages stages; this rank holds stages r, r + pp, ...; each is parallelized."""
    p, rt, module = b.cfg.parallel, b.rt, b.module
    pp, v = rt.axis_size("pp"), p.virtual_stages
    bounds = stage_bounds(module, pp * v, p.pp_split or None)
    mine = [rt.axis_rank("pp") + k * pp for k in range(v)]
    parts = [b.parallelize(pipeline_stage(module, bounds, s)) for s in mine]
    tied = module.tied_parameters() if hasattr(module, "tied_parameters") else {}
    strategy = PipelineStrategy(parts, mine, pp * v, rt, b.make_optimizer, b.loss_fn, b.precision, b.local_batch,
                                microbatches(b.cfg), p.pp_schedule, pipeline_parts(module)["blocks"], tied,
                                dp_sync=rt.axis_size("dp") > 1)
    return strategy


SCHEME = Scheme("pipeline", applies=lambda cfg: cfg.parallel.pp > 1, check=check, check_model=check_model,
                strategy=build)
