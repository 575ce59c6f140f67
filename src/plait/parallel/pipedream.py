"""PipeDream-2BW (`parallel.pp_schedule = "pipedream"`): 1F1B with no flush between steps, two weight versions.

Each pipeline rank runs its stage's one-forward-one-backward order over the stream of micro-batches of
consecutive steps. Stage s of p keeps d = p - 1 - s micro-batches in flight across a step boundary: the
backwards of step t's last d micro-batches run during step t + 1, each after one of step t + 1's forwards,
so the pipeline is not drained at the end of every step (1F1B's cool-down of p - 1 backwards is gone).

Weight stashing, double-buffered (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training"):
step t's micro-batches run on a copy of the weights taken when step t began (version V_t), their forwards and
their backwards alike, so a backward never sees weights its forward did not. Step t's gradient is complete on
every stage at the end of step t + 1 and is applied there:

    V_{t+2} = V_{t+1} - lr_{t+1} * grad f(V_t; batch t)        (step 1 applies nothing: V_1 = V_0)

Every update uses a gradient one version stale on every stage (the weight-version gap, 1, is in metrics.jsonl);
the rule does not depend on the layout, so pp = 2, pp = 4 and dp x pp follow one trajectory. A rank holds its
stage's weights three times: the optimizer's and the two versions in flight.

What is left of the bubble: the loss and the gradient norm are reduced over the stages at every step (the
trainer logs and clips them), a barrier right after the last stage's last backward, so each step still starts
with (p - 1) forwards of fill on the way to the last stage: bubble (p - 1) f / ((p - 1) f + m (f + b)) for
forward and backward slot times f and b, against 1F1B's (p - 1) / (m + p - 1).

A checkpoint (and the end of the run) drains the pipeline: the in-flight backwards run, and the pending
gradient (summed over a tied weight's copies and averaged over data-parallel replicas) is saved with the
checkpoint under the plain model's names, so a resume continues on the same trajectory.
"""

from __future__ import annotations

import copy
import time
from collections import deque

import torch
import torch.distributed as dist

from plait.comm.p2p import recv_message, send_tensor
from plait.parallel import pipeline
from plait.parallel.gradsync import align_grads, average_tensors
from plait.parallel.pipeline import PipelineStrategy, step_bubble, theoretical_bubble
from plait.parallel.saved import saved_tensors
from plait.parallel.scheme import Build
from plait.report.pipeline import plot_timeline

PENDING = "pipedream_pending_grad"  # checkpoint key of the drained step's gradient (plain names)
ACT, GRAD = 0, 1  # message kinds


class PipeDreamStrategy(PipelineStrategy):
    """One stage per pipeline rank, run in 1F1B order across steps on stashed weight versions."""

    def _make_schedule(self) -> None:
        self.part = self.parts[0]
        self.params = list(self.part.parameters())
        self.versions = [copy.deepcopy(self.part) for _ in range(2)]  # the weights steps t (t even / odd) run on
        me = dist.get_rank(self.pp_group)
        # the neighbouring stages' ranks (-1: none, at the first and last stage)
        self.prev = -1 if self.first else dist.get_global_rank(self.pp_group, me - 1)
        self.next = -1 if self.last else dist.get_global_rank(self.pp_group, me + 1)
        self.depth = self.num_stages - 1 - self.stage_ids[0]  # micro-batches in flight across a step boundary
        self.batch = 0  # this session's next step (its batch) counted from 0
        self.queue: deque = deque()  # forwarded, not yet backwarded: (batch, j, input, output or loss)
        self.finished: dict[int, int] = {}  # batch -> backwards done on this stage
        self.pending: dict[int, tuple[list, bool]] = {}  # batch -> (gradients aligned with params, reduced)
        self.applied = False  # whether the latest step gave the optimizer a gradient
        self.sends: list = []  # posted sends' works (a send completes once its receiver has posted the receive)
        names = {id(p): n for n, p in self.module.named_parameters(remove_duplicate=False)}
        self.names = [names[id(p)] for p in self.params]
        where = {id(p): i for i, p in enumerate(self.params)}
        self.tied_index = [where[id(p)] for p in self.tied.values()]  # the tied copies, in _sync_tied's order

    # ---- the step: this rank's 1F1B order over the micro-batch stream
    def forward_backward(self, micro_batches) -> torch.Tensor:
        t, m = self.batch, self.microbatches
        x = torch.cat([mb[0] for mb in micro_batches])
        y = torch.cat([mb[1] for mb in micro_batches])
        micro_batches = list(zip(x.chunk(m), y.chunk(m)))  # parallel.microbatches of the rank's batch
        version = self.versions[t % 2]  # step t - 2's backwards finished during step t - 1: this copy is free
        with torch.no_grad():
            for mine, theirs in zip(self.params, version.parameters()):
                theirs.copy_(mine)
                theirs.grad = None
        losses: list[torch.Tensor] = []
        self.events = []
        t0, peak = time.time(), len(self.queue)
        for j, (xj, yj) in enumerate(micro_batches):
            self._forward(t, j, version, xj, yj, losses)
            peak = max(peak, len(self.queue))
            if len(self.queue) > self.depth:
                self._backward(m)
        self._record_step(t0, time.time() - t0)
        self.peak_inflight[-1] = peak  # micro-batches of two steps are in flight at once
        self._prune_sends()
        self._apply(t - 1)  # step t - 1's gradient: complete on every stage now
        self.batch += 1
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=self.rt.device)
        dist.all_reduce(loss, group=self.pp_group)  # only the last stage contributes
        return loss

    def _forward(self, t: int, j: int, version, x, y, losses: list) -> None:
        if not self.first:
            x = self._recv(self.prev, ACT, t, j).requires_grad_(True)
        start = time.time()  # a slot is compute: waiting for its input is bubble
        meter = saved_tensors(self.activation_meter, self.saved_codec, self.module, (self.stage_ids[0], j, t))
        with meter, self.precision.autocast():
            out = version(x)
            if self.last:
                loss = self.loss_fn(out, y)
                losses.append(loss.detach().float())
                out = loss * (len(y) / self.local_batch)  # the rank's mean over its micro-batches
        if not self.last:
            self.sends += send_tensor(out.detach(), self.next, self.pp_group, tags=(ACT, t, j), async_op=True)
        self.queue.append((t, j, x, out))
        self.events.append((self.stage_ids[0], "F", j, start, time.time()))

    def _backward(self, m: int) -> None:
        t, j, x, out = self.queue.popleft()
        grad = None if self.last else self._recv(self.next, GRAD, t, j)
        start = time.time()
        out.backward(grad)
        if not self.first:
            self.sends += send_tensor(x.grad, self.prev, self.pp_group, tags=(GRAD, t, j), async_op=True)
        # the timeline labels a backward of the previous step's micro-batch j as B j' (drawn in this step)
        self.events.append((self.stage_ids[0], "B", j if t == self.batch else f"{j}'", start, time.time()))
        self.finished[t] = self.finished.get(t, 0) + 1
        if self.finished[t] == m:  # step t's gradient is complete on this stage: take it out of its version
            version = self.versions[t % 2]
            grads = []
            for p in version.parameters():
                grads.append(p.grad if p.grad is not None else None)
                p.grad = None
            self.pending[t] = (grads, False)
            del self.finished[t]

    def _recv(self, src: int, kind: int, t: int, j: int) -> torch.Tensor:
        tags, tensor = recv_message(src, self.rt.device, self.pp_group)
        if tags[:3] != [kind, t, j] or tensor is None:
            raise RuntimeError(f"pipedream: stage {self.stage_ids[0]} expected {('activation', 'gradient')[kind]} "
                               f"of step {t} micro-batch {j} from rank {src}, got tags {tags[:3]}")
        return tensor

    def _prune_sends(self) -> None:
        self.sends = [w for w in self.sends if not w.is_completed()]

    # ---- gradients: reduced over the tied copies and the data-parallel replicas, then given to the optimizer
    def _reduce(self, grads: list) -> list:
        for i in self.tied_index:
            if self._tied_group is not None and grads[i] is not None:
                dist.all_reduce(grads[i], group=self._tied_group)
        if self.dp_sync:
            average_tensors([g for g in grads if g is not None], self.rt.axis_group("dp"), self.rt.axis_size("dp"))
        return grads

    def _apply(self, t: int) -> None:
        """Make step t's gradient the parameters' (none before the first step: the optimizer then does nothing)."""
        self.applied = t in self.pending
        if not self.applied:
            return
        grads, reduced = self.pending.pop(t)
        if not reduced:
            grads = self._reduce(grads)
        for p, g in zip(self.params, grads):
            p.grad = g
        align_grads(self.params)

    def _drain(self) -> None:
        """Run the in-flight backwards: the latest step's gradient becomes pending and reduced, nothing is in flight."""
        m = self.microbatches
        while self.queue:
            self._backward(m)
        for w in self.sends:
            w.wait()
        self.sends = []
        for t, (grads, reduced) in list(self.pending.items()):
            if not reduced:
                self.pending[t] = (self._reduce(grads), True)

    def clip_grad_norm(self, max_norm: float, need_norm: bool = True):
        if not self.applied:  # the first step: no gradient yet (the same on every rank)
            return torch.zeros((), device=self.rt.device)
        return super().clip_grad_norm(max_norm, need_norm)

    def figures(self, reports: list[dict], run_dir) -> dict:
        """The measured bubble next to PipeDream's (and 1F1B's) theory, from the recorded slot times."""
        summary = pipedream_summary(reports, self.pp, self.microbatches)
        summary["stage_blocks"] = [[a, z] for a, z in self.bounds]
        if run_dir is not None:
            plot_timeline(reports, summary, run_dir / "pipeline.png")
        return {"pipeline": summary}

    def step_metrics(self, record: dict) -> dict:
        return {"weight_version_gap": 1}

    def finish(self) -> None:
        self._drain()

    # ---- checkpoints: the drained step's gradient rides along, under the plain names
    def state_dict(self) -> dict:
        self._drain()
        sd = super().state_dict()
        grads = self.pending.get(self.batch - 1, ([None] * len(self.params), True))[0]
        pending = {}
        for name, p, g in zip(self.names, self.params, grads):
            name = self._alias_names.get(name, name) if self._alias_ids else name
            pending[name] = g.detach() if g is not None else torch.zeros_like(p)
        sd[PENDING] = pending
        return sd

    optional_state = (PENDING,)  # a flushing schedule's checkpoint has none: its gradients are all applied

    def load_state_dict(self, state: dict) -> None:
        pending = state.pop(PENDING, None)
        super().load_state_dict(state)
        if pending is None:  # from another schedule's checkpoint: the next step applies nothing, as the first does
            self.pending = {}
            return
        grads = []
        for name, p in zip(self.names, self.params):
            name = self._alias_names.get(name, name) if self._alias_ids else name
            grads.append(pending[name].to(p.device).clone())
        self.pending = {self.batch - 1: (grads, True)}  # applied at the end of the next step


def pipedream_summary(per_rank: list[dict], p: int, m: int) -> dict:
    """Measured bubble per step (1 - mean busy time per stage rank / the step's span), averaged over the latest
    steps after the first, next to (p - 1) f / ((p - 1) f + m (f + b)) with the mean measured forward and backward
    slot times f and b, and 1F1B's (p - 1) / (m + p - 1)."""
    first: dict[int, dict] = {}
    for r in per_rank:
        first.setdefault(r["pp_rank"], r)
    one = [first[k] for k in sorted(first)]
    measured: list = []
    slots: dict[str, list] = {"F": [], "B": []}
    for step in zip(*(r["step_events"] for r in one)):
        if not all(step):
            continue
        span, busy = step_bubble(list(step))
        if span > 0:
            measured.append(1.0 - busy / span)
        for ev in step:
            for e in ev:
                slots[e[1]].append(e[4] - e[3])
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    f, b = mean(slots["F"]), mean(slots["B"])
    theory = (p - 1) * f / ((p - 1) * f + m * (f + b)) if f + b > 0 else 0.0
    return {
        "schedule": "pipedream", "stages": p, "microbatches": m,
        "bubble_fraction": mean(measured),
        "bubble_fraction_theory": theory,
        "bubble_fraction_1f1b_theory": theoretical_bubble(p, m),
        "forward_ms": f * 1000, "backward_ms": b * 1000,
        "weight_version_gap": 1, "weight_versions": 2,
        "steps_measured": len(measured),
        "peak_inflight_per_rank": [r["peak_inflight"] for r in one],
    }


def build(b: Build) -> PipeDreamStrategy:
    """The pipeline's build with PipeDream's strategy (plait.parallel.pipeline.build cuts the stages)."""
    strategy = pipeline.build(b, PipeDreamStrategy)
    assert isinstance(strategy, PipeDreamStrategy)
    return strategy
