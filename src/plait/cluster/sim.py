"""Replay a trace of jobs on D device slots under a policy, with a simulated clock.

Events are arrivals, completions and the moments a policy's decision changes by itself (a Tiresias job crossing a
queue threshold or due for promotion, the end of a Gandiva turn); between events every
running job makes progress at one second of work per second. A preempted job has checkpointed (plait's SIGTERM
path); when it runs again it first spends `switch_cost` seconds restoring, holding its slots without progress.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from plait.cluster.policies import WAKEUPS, JobView, Params, decide
from plait.errors import ConfigError


@dataclass(frozen=True)
class TraceJob:
    id: str
    arrival: float  # seconds
    devices: int
    duration: float  # seconds of work at `devices`


@dataclass
class JobOutcome:
    id: str
    arrival: float
    devices: int
    duration: float
    first_start: float = math.nan
    finish: float = math.nan
    preemptions: int = 0

    @property
    def jct(self) -> float:
        return self.finish - self.arrival

    @property
    def queueing(self) -> float:
        return self.first_start - self.arrival


@dataclass
class SimResult:
    policy: str
    devices: int
    jobs: list[JobOutcome]
    busy: float  # device-seconds held
    useful: float  # device-seconds of progress (busy minus restores)
    decisions: int
    segments: list[tuple[str, float, float, int]] = field(default_factory=list)  # (job, start, end, devices)

    @property
    def makespan(self) -> float:
        return max(j.finish for j in self.jobs) - min(j.arrival for j in self.jobs)

    @property
    def avg_jct(self) -> float:
        return sum(j.jct for j in self.jobs) / len(self.jobs)

    def percentile_jct(self, q: float) -> float:
        xs = sorted(j.jct for j in self.jobs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    @property
    def utilisation(self) -> float:
        return self.busy / (self.devices * self.makespan)

    def summary(self) -> dict:
        return {"policy": self.policy, "jobs": len(self.jobs), "devices": self.devices,
                "avg_jct_s": self.avg_jct, "median_jct_s": self.percentile_jct(0.5),
                "p95_jct_s": self.percentile_jct(0.95), "makespan_s": self.makespan,
                "avg_queueing_s": sum(j.queueing for j in self.jobs) / len(self.jobs),
                "preemptions": sum(j.preemptions for j in self.jobs), "utilisation": self.utilisation,
                "useful_utilisation": self.useful / (self.devices * self.makespan), "decisions": self.decisions}


@dataclass
class _State:
    job: TraceJob
    remaining: float
    attained: float = 0.0
    executed: float = 0.0
    running: bool = False
    slice_start: float = 0.0
    last_run: float = -1.0
    waiting_since: float = 0.0
    restore_left: float = 0.0
    preempted_before: bool = False

    def view(self) -> JobView:
        return JobView(self.job.id, self.job.arrival, self.job.devices, self.remaining, self.attained,
                       self.executed, self.running, self.slice_start, self.last_run, self.waiting_since)


def simulate(trace: list[TraceJob], devices: int, policy: str, params: Params = Params(),
             switch_cost: float = 10.0, keep_segments: bool = False) -> SimResult:
    """Run the trace to its end; every job finishes (a policy that leaves slots idle forever is a bug: raised)."""
    if not trace:
        raise ConfigError("the trace has no jobs")
    too_big = [j for j in trace if j.devices > devices]
    if too_big:
        raise ConfigError(f"job {too_big[0].id} needs {too_big[0].devices} devices but the cluster has {devices}; "
                          f"raise --devices or drop the job")
    pending = sorted(trace, key=lambda j: (j.arrival, j.id))
    outcomes = {j.id: JobOutcome(j.id, j.arrival, j.devices, j.duration) for j in trace}
    active: dict[str, _State] = {}
    segments: list[tuple[str, float, float, int]] = []
    open_seg: dict[str, float] = {}
    now = pending[0].arrival
    nxt = 0
    busy = useful = 0.0
    decisions = 0
    wakeup = WAKEUPS.get(policy)
    while nxt < len(pending) or active:
        while nxt < len(pending) and pending[nxt].arrival <= now + 1e-9:
            j = pending[nxt]
            active[j.id] = _State(j, j.duration, waiting_since=j.arrival)
            nxt += 1
        d = decide(policy, now, [s.view() for s in active.values()], devices, params)
        decisions += 1
        for i in d.preempt:
            s = active[i]
            s.running, s.waiting_since, s.preempted_before = False, now, True
            outcomes[i].preemptions += 1
            if keep_segments:
                segments.append((i, open_seg.pop(i), now, s.job.devices))
        for i in d.start:
            s = active[i]
            s.running, s.slice_start = True, now
            s.restore_left = switch_cost if s.preempted_before else 0.0
            if math.isnan(outcomes[i].first_start):
                outcomes[i].first_start = now
            open_seg[i] = now
        for i in d.keep:  # a job that keeps its slots past a quantum starts a new turn
            s = active[i]
            if now - s.slice_start >= params.quantum - 1e-9:
                s.slice_start = now
        running = [s for s in active.values() if s.running]
        # the next event: an arrival, a completion, the end of a quantum
        t_next = pending[nxt].arrival if nxt < len(pending) else math.inf
        if running:
            t_next = min(t_next, min(now + s.restore_left + s.remaining for s in running))
        if wakeup is not None and len(active) > len(running):  # someone waits: the decision may change
            t_next = min([t_next] + [t for t in (wakeup(now, s.view(), params) for s in active.values())
                                     if t > now + 1e-9])
        if math.isinf(t_next):
            raise AssertionError(f"policy {policy} left {len(active)} jobs waiting on idle slots at t={now:.0f}s")
        dt = t_next - now
        for s in running:
            restore = min(s.restore_left, dt)
            work = dt - restore
            s.restore_left -= restore
            s.remaining -= work
            s.attained += s.job.devices * dt
            s.executed += dt
            s.last_run = t_next
            busy += s.job.devices * dt
            useful += s.job.devices * work
        now = t_next
        for s in running:
            if s.remaining <= 1e-6 * max(1.0, s.job.duration):
                outcomes[s.job.id].finish = now
                del active[s.job.id]
                if keep_segments:
                    segments.append((s.job.id, open_seg.pop(s.job.id), now, s.job.devices))
    return SimResult(policy, devices, list(outcomes.values()), busy, useful, decisions, segments)
