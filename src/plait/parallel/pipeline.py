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

from plait.comm.compression import ratio_metrics
from plait.comm.p2p import recv_message, send_tensor
from plait.models.moe import moe_layers
from plait.models.protocols import pipeline_parts, tied_parameters
from plait.parallel.base import Strategy, correct_predictions
from plait.parallel.embedding import dp_sharded_parameters, gather_over_dp
from plait.parallel.fsdp import stop_unsharded
from plait.parallel.gradsync import align_grads, allreduce_grads, clip_grad_norm, clip_to, norm_sq
from plait.parallel.keys import PipelineKeys
from plait.parallel.saved import saved_tensors
from plait.parallel.scheme import Build
from plait.parallel.split import pipeline_stage, stage_bounds
from plait.parallel.stage_zero1 import StageOwners
from plait.report.pipeline import plot_timeline

KEEP_STEPS = 32  # steps whose slots each rank keeps for the bubble's analysis (the latest)
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B"}


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
    if "." in blocks_attr:  # blocks inside a submodule (a transformers model's model.layers)
        return _nested_union(parts)
    blocks = nn.ModuleDict()
    for part in parts:
        for name, param in part._parameters.items():  # a parameter of the model's own that a stage keeps
            if param is not None:
                union.register_parameter(name, param)
        for name, child in part.named_children():
            if name == blocks_attr:
                for k, b in child.named_children():
                    blocks[k] = b
            elif child is not None:
                union.add_module(name, child)
    union.add_module(blocks_attr, blocks)
    return union


def _nested_union(parts: list[nn.Module]) -> nn.Module:
    """The union by path: every module that holds parameters itself, at its name in its stage (the plain model's),
    under plain containers."""
    union = nn.Module()
    for part in parts:
        for name, mod in part.named_modules():
            if not name or not any(p is not None for p in mod._parameters.values()):
                continue
            parent = union
            *path, leaf = name.split(".")
            for atom in path:
                if not hasattr(parent, atom):
                    parent.add_module(atom, nn.Module())
                parent = getattr(parent, atom)
            if not hasattr(parent, leaf):
                parent.add_module(leaf, mod)
    return union


class PipelineStrategy(Strategy):
    name = "pipeline"
    sharded = True

    def __init__(self, parts: list[nn.Module], stage_ids: list[int], num_stages: int, rt, make_optimizer, loss_fn,
                 precision, local_batch: int, microbatches: int, schedule: str, blocks_attr: str,
                 tied: dict[str, str], dp_sync: bool, embedding_sharding: bool = False, zero1: bool = False):
        self.rt = rt
        self.pp_group = rt.axis_group("pp")
        self.pp = rt.axis_size("pp")
        self.parts, self.stage_ids, self.num_stages = parts, stage_ids, num_stages
        self.microbatches, self.schedule_name = microbatches, schedule
        self.virtual = len(parts)
        union = union_module(parts, blocks_attr)
        # ZeRO-1 in the stages: this rank's optimizer steps the parameters it owns (plait.parallel.stage_zero1)
        self.owners = StageOwners(union, rt.axis_group("dp")) if zero1 else None
        optimizer = make_optimizer(union, only=self.owners.mine) if self.owners else make_optimizer(union)
        super().__init__(nn.ModuleList(parts), union, optimizer, loss_fn, precision, local_batch)
        self.bounds: list[tuple[int, int]] = []  # [start, stop) of every stage's blocks (set by build)
        self.name = f"pipeline-{schedule}"
        self.dp_sync = dp_sync
        self.first, self.last = 0 in stage_ids, (num_stages - 1) in stage_ids
        self._setup_tied(tied)
        # embedding tables sharded over dp (parallel.embedding_sharding, DeepFM's first stage): not all-reduced
        self._embedding_sharding = rt.axis_size("dp") > 1 and embedding_sharding
        self._dp_sharded = frozenset(id(p) for part in parts for p in dp_sharded_parameters(part))
        self.events: list[tuple] = []
        self.step_events: list[list[tuple]] = []  # per step: this rank's slots (stage, "F"/"B", mb, start, end)
        self.peak_inflight: list[int] = []  # per step: the most micro-batches whose activations this rank held
        self.last_timeline: list[tuple] = []
        self._last_forward = None
        self.distiller = None  # distill.teacher's Distiller (set by build from the plain student)
        self._teacher: list[torch.Tensor] = []  # its logits for this step's micro-batches (last stage)
        # MoE blocks in a stage: the load-balancing loss's gradient is injected at each layer's output (no stage but
        # the last has a loss to add it to), with the model's weight; the schedule scales it as it scales the loss's
        self.moe = [m for p in parts for m in moe_layers(p)]
        for p in parts:
            for m in moe_layers(p):
                m.aux_grad = float(getattr(p, "moe_aux_weight", 0.0) or 0.0)
        self._aux_weights = [m.aux_grad for m in self.moe]
        self._make_schedule()

    def _make_schedule(self) -> None:
        """torch.distributed.pipelining's stages and flushing schedule over this rank's parts, instrumented."""
        # imported here: torch.distributed.pipelining brings in torch._dynamo (~0.4 s in every worker otherwise)
        from torch.distributed import pipelining

        self.stages = [pipelining.PipelineStage(p, s, self.num_stages, self.rt.device, group=self.pp_group)
                       for p, s in zip(self.parts, self.stage_ids)]
        cls = getattr(pipelining, SCHEDULES[self.schedule_name])
        # fp16: each micro-batch's loss is divided by their count before backward (scaled as one process scales it),
        # not the gradients after it, so that the scaled backward's values stay within fp16's range as one process's do
        self.schedule = cls(self.stages if self.schedule_name == "interleaved-1f1b" else self.stages[0],
                            self.microbatches, loss_fn=self._loss, scale_grads=self.precision.scaler is None)
        for st in self.stages:
            self._instrument(st)

    # ---- the step
    def _loss(self, output, target):
        if self.distiller is not None and self._teacher and self._last_forward is not None:
            self.distiller.hand(self._teacher[self._last_forward[1]])  # the piece of the micro-batch just run
        # the loss's saved tensors belong to the micro-batch just run
        with saved_tensors(self.activation_meter, self.saved_codec, self.module, self._last_forward):
            loss = self.loss_fn(output, target)
        return loss if self.precision.scaler is None else self.precision.scaler.scale(loss) / self.microbatches

    def forward_backward(self, micro_batches) -> torch.Tensor:
        x = torch.cat([m[0] for m in micro_batches])
        y = torch.cat([m[1] for m in micro_batches])
        losses: list = []
        self.events = []
        factor = self.precision.split_scale(self.microbatches)  # what a loss is multiplied by before backward
        for m, weight in zip(self.moe, self._aux_weights):  # their injected gradients likewise
            m.aux_grad = weight * factor
        t0 = time.time()  # wall clock: the timeline lines up ranks of different processes (and machines)
        with self.precision.autocast():
            if self.distiller is not None and self.last:  # distill.teacher: the last stage reads x too
                with torch.no_grad():
                    self._teacher = list(self.distiller.teacher(x).chunk(self.microbatches))
            self.schedule.step(*((x,) if self.first else ()), target=y if self.last else None,
                               losses=losses if self.last else None)
        span = time.time() - t0
        self._record_step(t0, span)
        for part in self.parts:  # ZeRO inside the stages, compressed: the step's reduce-scatters are done
            if (compression := getattr(part, "plait_compression", None)) is not None:
                compression.end_step()
        align_grads(self.module.parameters())
        self._sync_tied()
        if self.dp_sync:  # a sharded table's gradient is whole on its owner already (plait.parallel.embedding)
            allreduce_grads([p for p in self.module.parameters() if id(p) not in self._dp_sharded],
                            self.rt.axis_group("dp"), self.rt.axis_size("dp"))
        loss = torch.stack([loss.detach().float() for loss in losses]).mean() if losses else torch.zeros(())
        loss = loss.to(self.rt.device) / factor
        injected = [t for m in self.moe for t in [m.take_injected()] if t is not None]
        if injected:  # every stage's MoE layers' weighted load-balancing losses, a mean over the micro-batches
            loss = loss + torch.stack(injected).sum().float().to(loss.device) / factor / self.microbatches
        dist.all_reduce(loss, group=self.pp_group)  # the last stage's loss, plus each stage's injected terms
        return loss

    def clip_grad_norm(self, max_norm: float, need_norm: bool = True):
        """Each stage holds its own parameters: squares summed over the pipeline; a tied copy is clipped, not counted."""
        self.precision.unscale(self.optimizer, self.overflow_group())
        if max_norm <= 0 and not need_norm:
            return None
        params = list(self.module.parameters())
        counted = [p for p in params if id(p) not in self._alias_ids and id(p) not in self._dp_sharded]
        copies = [p for p in params if id(p) in self._alias_ids]
        if not self._embedding_sharding:
            return clip_grad_norm([], max_norm, partial=counted, group=self.pp_group, clip_also=copies)
        # sharded tables: their rows' squares summed over dp first, then every stage's over the pipeline
        sharded = [g.to_local() if hasattr(g, "to_local") else g
                   for p in params if id(p) in self._dp_sharded and (g := p.grad) is not None]
        device = self.rt.device
        tables = norm_sq(sharded, device)
        dist.all_reduce(tables, group=self.rt.axis_group("dp"))
        sq = norm_sq([p.grad for p in counted if p.grad is not None], device) + tables
        dist.all_reduce(sq, group=self.pp_group)
        norm = sq.sqrt().float()
        clip_to([p.grad for p in params if p.grad is not None], norm, max_norm)
        return norm

    def optimizer_step(self) -> None:
        super().optimizer_step()
        if self.owners is not None:  # ZeRO-1: the owners' updates to the other dp ranks; every gradient dropped
            self.owners.share()
            for p in self.module.parameters():
                p.grad = None

    def step_metrics(self, record: dict) -> dict:
        """With top-k / int8 / PowerSGD of the stages' ZeRO reduce-scatters: their uncompressed bytes and the ratio."""
        return ratio_metrics([getattr(part, "plait_compression", None) for part in self.parts], record)

    def stop_training(self, params: list) -> None:
        """As the base, and under ZeRO inside the stages FSDP2's unsharded copies stop requiring a gradient too."""
        super().stop_training(params)
        for part in self.parts:
            stop_unsharded(part, params)

    @property
    def tied_copies(self) -> frozenset[int]:
        """ids of this stage's parameters that copy a weight of another stage (the last stage's tied head)."""
        return self._alias_ids

    # ---- a weight shared by the first and last stage
    def _setup_tied(self, tied: dict[str, str]) -> None:
        """Process groups joining, for every (dp, tp) position, the ranks of the first and last stage."""
        self.tied, self._tied_group = {}, None
        self._alias_ids: frozenset[int] = frozenset()
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
            if not param.requires_grad:  # frozen (finetune.freeze, LoRA's base) on both stages alike: nothing to sum
                continue
            if param.grad is None:  # no path to it this step (a progressive freeze cut the embedding's): adds nothing
                param.grad = torch.zeros_like(param)
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
        if self._embedding_sharding:  # whole tables live on their owner only
            sd = gather_over_dp(sd, self.rt.axis_group("dp"), self.rt.axis_size("dp"))
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
        h: torch.Tensor | tuple = x
        for s in range(self.num_stages):
            owner = s % self.pp
            if owner != me:
                continue
            prev = (s - 1) % self.pp
            if s > 0 and prev != me:
                h = recv_activations(dist.get_global_rank(self.pp_group, prev), x.device)
            with self.precision.autocast():
                h = self.parts[self.stage_ids.index(s)](*(h if isinstance(h, tuple) else (h,)))
            nxt = (s + 1) % self.pp
            if s < self.num_stages - 1 and nxt != me:
                send_activations(h, dist.get_global_rank(self.pp_group, nxt))
        out = torch.zeros(2, dtype=torch.float64, device=x.device)
        if self.last:
            assert isinstance(h, torch.Tensor), "the last stage returns the model's output"
            out[0] = self.loss_fn(h, y).double()
            out[1] = correct_predictions(h, y)
        dist.all_reduce(out, group=self.pp_group)
        return out[0], out[1]

    # ---- timeline
    def _instrument(self, stage) -> None:
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
        sid = stage.stage_index

        def forward_one_chunk(mb, *args, **kwargs):
            t = time.time()
            self._last_forward = (sid, mb, len(self.peak_inflight))
            for m in self.moe:  # what the MoE layers inject, by micro-batch (plait.models.moe)
                m.injected_key = (sid, mb)
            with saved_tensors(self.activation_meter, self.saved_codec, self.module, self._last_forward):
                out = fwd(mb, *args, **kwargs)
            for m in self.moe:
                m.injected_key = None
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
        inflight = peak = 0
        for _, kind, _, _, _ in sorted(self.events, key=lambda e: e[3]):
            inflight += 1 if kind == "F" else -1
            peak = max(peak, inflight)
        self.peak_inflight.append(peak)
        self.step_events.append(list(self.events))
        if len(self.step_events) > KEEP_STEPS + 1:  # the first step (setup) and the latest KEEP_STEPS
            del self.step_events[1]
        self.last_timeline = list(self.events)  # absolute times; the plot lines ranks up

    def figures(self, reports: list[dict], run_dir) -> dict:
        """The measured bubble next to the theory, micro-batches in flight per stage, and the timeline plot."""
        summary = pipeline_summary(reports, self.schedule_name, self.pp, self.microbatches, self.virtual)
        summary["stage_blocks"] = [[a, z] for a, z in self.bounds]  # [start, stop) per stage
        if run_dir is not None:
            plot_timeline(reports, summary, run_dir / "pipeline.png")
        return {"pipeline": summary}

    def report(self) -> dict:
        """This rank's pipeline figures: the slots of the latest steps after the first (which includes setup)."""
        return {
            "pp_rank": dist.get_rank(self.pp_group),
            "stages": self.stage_ids,
            "step_events": self.step_events[1:] or self.step_events,
            "peak_inflight": max(self.peak_inflight[1:] or self.peak_inflight, default=0),
            "timeline": self.last_timeline,
        }


def send_activations(h: torch.Tensor | tuple, dst: int) -> None:
    """A stage's output, one tensor or several (DeepFM's activations and FM logit), to the next stage's rank."""
    hs = h if isinstance(h, tuple) else (h,)
    for t in hs:
        send_tensor(t, dst, tags=(len(hs),))


def recv_activations(src: int, device) -> torch.Tensor | tuple:
    """What send_activations sent, floating tensors in float32."""
    tags, t = recv_message(src, device)
    hs = [t] + [recv_message(src, device)[1] for _ in range(tags[0] - 1)]
    out = [a.float() if a.is_floating_point() else a for a in hs if a is not None]
    return out[0] if len(out) == 1 else tuple(out)


def step_bubble(events: list[list[tuple]]) -> tuple[float, float]:
    """One step of one pipeline: (span, mean busy seconds per stage rank). events[k]: pp rank k's slots
    (stage, "F"/"B", micro-batch, start, end). The span runs from the first forward on any stage to the last
    backward on any stage (a rank's own schedule call ends before the pipeline does and would hide its idling)."""
    span = max(e[4] for ev in events for e in ev) - min(e[3] for ev in events for e in ev)
    return span, sum(sum(e[4] - e[3] for e in ev) for ev in events) / len(events)


def replay_span(events: list[list[tuple]], durations: dict | None = None) -> float:
    """The span of the same schedule with no cost but compute: each rank runs its slots in the recorded order, each
    as long as recorded (or durations["F"/"B"]), as soon as its input is there: micro-batch i's forward on stage s
    after the one on stage s - 1, its backward after the one on stage s + 1 (after its forward on the last stage).
    A lower bound on the measured span; the difference is what the step spent on anything but the schedule's slots
    (sends and receives, the schedule's Python between slots)."""
    order = [sorted(ev, key=lambda e: e[3]) for ev in events]
    last = max(e[0] for ev in events for e in ev)
    length = {e[:3]: durations[e[1]] if durations else e[4] - e[3] for o in order for e in o}
    end: dict[tuple, float] = {}
    clock, done = [0.0] * len(order), [0] * len(order)
    while any(d < len(o) for d, o in zip(done, order)):
        moved = False
        for r, o in enumerate(order):
            while done[r] < len(o):
                s, kind, mb = o[done[r]][:3]
                if kind == "F":
                    after = (s - 1, "F", mb) if s > 0 else None
                else:
                    after = (s + 1, "B", mb) if s < last else (s, "F", mb)
                if after is not None and after not in end:
                    break
                start = end[after] if after is not None else 0.0
                end[s, kind, mb] = clock[r] = max(clock[r], start) + length[s, kind, mb]
                done[r] += 1
                moved = True
        if not moved:
            raise ValueError("the recorded slot orders wait for each other: not one pipeline's step")
    return max(end.values())


def pipeline_summary(per_rank: list[dict], schedule: str, p: int, m: int, v: int) -> dict:
    """Measured bubble next to the theory, what it is made of, and in-flight micro-batches per stage.

    bubble_fraction = bubble_fraction_theory + imbalance_fraction + fixed_cost_fraction, per step, averaged over the
    latest steps after the first:
      theory       (p - 1) / (m + p - 1) [/ v]: equal slots, nothing but compute
      imbalance    the recorded schedule replayed with its measured slot lengths and no other cost, less the theory:
                   stages or micro-batches of unequal length (fix: balance the stages, parallel.pp_split)
      fixed cost   the measured bubble less that replay: time between slots (send/recv, the schedule's Python),
                   also as ms per micro-batch (fix: larger micro-batches, fewer of them)
    """
    first: dict[int, dict] = {}  # one pipeline: the first rank (in rank order) of each pp rank
    for r in per_rank:
        first.setdefault(r["pp_rank"], r)
    one = [first[k] for k in sorted(first)]
    theory = theoretical_bubble(p, m, v)
    measured, replayed, fixed_ms = [], [], []
    for step in zip(*(r["step_events"] for r in one)):
        if not all(step):
            continue
        span, busy = step_bubble(list(step))
        ideal = replay_span(list(step))
        if span <= 0 or ideal <= 0:
            continue
        measured.append(1.0 - busy / span)
        replayed.append(1.0 - busy / ideal)
        fixed_ms.append(max(0.0, span - ideal) * 1000 / m)
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    bubble, schedule_bubble = mean(measured), mean(replayed)
    return {
        "schedule": schedule, "stages": p * v, "microbatches": m,
        "bubble_fraction": bubble,
        "bubble_fraction_theory": theory,
        "imbalance_fraction": schedule_bubble - theory if measured else 0.0,
        "fixed_cost_fraction": bubble - schedule_bubble,
        "fixed_cost_ms_per_microbatch": mean(fixed_ms),
        "steps_measured": len(measured),
        "peak_inflight_per_rank": [r["peak_inflight"] for r in one],
    }


def stages_of(b: Build) -> tuple[list, list[int], list[nn.Module]]:
    """(bounds, this rank's stage indices, its parallelized stages): pp * virtual_stages stages of the plain model;
    this rank holds stages r, r + pp, ..."""
    keys, rt, module = b.keys(PipelineKeys), b.rt, b.module
    pp, v = rt.axis_size("pp"), keys.virtual_stages
    if keys.pp_split == "auto":
        from plait.parallel.stagetime import auto_bounds  # lazily: it imports the trainer's timing helpers

        bounds, times = auto_bounds(module, pp * v, b.cfg, rt)
        ms = "; ".join(f"pp rank {r}: " + " ".join(f"{t * 1000:.1f}" for t in row) for r, row in enumerate(times))
        rt.print(f"pp_split = auto: blocks {[f'{a}-{z - 1}' for a, z in bounds]} per stage, from each block's "
                 f"forward+backward ms on each pipeline rank ({ms})")
    else:
        bounds = stage_bounds(module, pp * v, keys.pp_split or None)
    mine = [rt.axis_rank("pp") + k * pp for k in range(v)]
    parts = [b.parallelize(pipeline_stage(module, bounds, s)) for s in mine]
    for part in parts:  # shard-only initialisation: each stage fills its own parameters (tp has, if it split them)
        b.materialize(part)
    return bounds, mine, parts


def build(b: Build, cls: type | None = None) -> PipelineStrategy:
    """The pipeline strategy (cls: PipelineStrategy, or a subclass such as PipeDream's) over this rank's stages."""
    bounds, mine, parts = stages_of(b)
    module, rt = b.module, b.rt
    tied = tied_parameters(module)
    strategy = (cls or PipelineStrategy)(parts, mine, b.layout.stages, rt, b.make_optimizer, b.loss_fn, b.precision,
                                         b.local_batch, b.layout.pipeline_microbatches, b.layout.schedule,
                                         pipeline_parts(module)["blocks"], tied,
                                         dp_sync=rt.axis_size("dp") > 1 and not b.layout.shards_gradients,
                                         embedding_sharding=b.layout.embedding_sharding != "none",
                                         zero1=b.layout.zero == 1 and rt.axis_size("dp") > 1)
    strategy.bounds = bounds
    strategy.distiller = getattr(b.module, "plait_distiller", None)
    if strategy.distiller is not None:  # a stage's forward is not the student's: the last stage hands its pieces
        strategy.distiller.hooked = False
    return strategy
