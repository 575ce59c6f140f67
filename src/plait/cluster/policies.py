"""Scheduling policies for a shared cluster: pure functions of the queue's state.

A policy sees every job that has arrived and not finished (a `JobView`) and the number of device slots, and returns
the ids of the jobs that hold devices until the next decision. It keeps no state of its own and reads no clock: the
same views give the same decision, so the simulator, a real run on local processes and the tests share one code
path. Jobs are gang-scheduled: a job holds exactly the devices it asked for, or none.

    fifo      first come, first served, never preempts; the head of the queue blocks the jobs behind it
              (the YARN capacity scheduler the papers measure against)
    srtf      shortest remaining time first, preemptive, smaller jobs fill what is left; needs every job's
              remaining time in advance (an oracle: the bound Tiresias compares with)
    tiresias  two-dimensional least attained service (Gu et al., NSDI'19): a job's service is devices x seconds
              it has run; jobs sit in priority queues split at `thresholds` (device-seconds), first come first
              served within a queue, preemptive; a job that waited longer than `promote` x its run time goes back
              to the top queue (starvation guard)
    gandiva   time-slicing (Xiao et al., OSDI'18): when jobs outnumber slots they take turns, each turn lasting at
              least `quantum` seconds; the jobs that ran least recently go first (round robin)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from plait.errors import ConfigError


@dataclass(frozen=True)
class JobView:
    """What a policy may look at: one job that has arrived and not finished."""

    id: str
    arrival: float  # seconds since the trace's start
    devices: int  # slots it needs while it runs (gang)
    remaining: float  # seconds of work left at `devices` (only srtf reads it: the others do not know the future)
    attained: float = 0.0  # device-seconds it has held so far
    executed: float = 0.0  # seconds it has run so far
    running: bool = False
    slice_start: float = 0.0  # when its current turn began (running jobs)
    last_run: float = -1.0  # when it last held devices; -1: never
    waiting_since: float = 0.0  # when it last stopped (or arrived)


@dataclass(frozen=True)
class Params:
    quantum: float = 360.0  # gandiva: the shortest turn, seconds
    thresholds: tuple[float, ...] = (3200.0,)  # tiresias: queue boundaries in device-seconds (the paper's 2 queues)
    promote: float = 8.0  # tiresias: waited > promote x executed -> back to the top queue; 0 turns it off


Policy = Callable[[float, list[JobView], int, Params], frozenset[str]]


def _fill(order: list[JobView], devices: int, keep: list[JobView] = (), block: bool = False) -> frozenset[str]:
    """Give slots in `order` after the jobs in `keep`; a job that does not fit is skipped (or stops the fill)."""
    chosen = [j.id for j in keep]
    free = devices - sum(j.devices for j in keep)
    for j in order:
        if j.devices <= free:
            chosen.append(j.id)
            free -= j.devices
        elif block:
            break
    return frozenset(chosen)


def fifo(now: float, jobs: list[JobView], devices: int, params: Params) -> frozenset[str]:
    running = [j for j in jobs if j.running]
    waiting = sorted((j for j in jobs if not j.running), key=lambda j: (j.arrival, j.id))
    return _fill(waiting, devices, keep=running, block=True)


def srtf(now: float, jobs: list[JobView], devices: int, params: Params) -> frozenset[str]:
    return _fill(sorted(jobs, key=lambda j: (j.remaining, j.arrival, j.id)), devices)


def tiresias_queue(job: JobView, now: float, params: Params) -> int:
    """The priority queue a job is in: 0 is served first."""
    waited = now - job.waiting_since
    if not job.running and params.promote > 0 and job.executed > 0 and waited > params.promote * job.executed:
        return 0
    return sum(job.attained >= t for t in params.thresholds)


def tiresias(now: float, jobs: list[JobView], devices: int, params: Params) -> frozenset[str]:
    return _fill(sorted(jobs, key=lambda j: (tiresias_queue(j, now, params), j.arrival, j.id)), devices)


def gandiva(now: float, jobs: list[JobView], devices: int, params: Params) -> frozenset[str]:
    # a running job keeps its slots until its turn has lasted a quantum; then every job that is due competes,
    # the one that ran least recently first
    mid_turn = [j for j in jobs if j.running and now - j.slice_start < params.quantum - 1e-9]
    due = sorted((j for j in jobs if j not in mid_turn), key=lambda j: (j.last_run, j.arrival, j.id))
    return _fill(due, devices, keep=mid_turn)


def tiresias_wakeup(now: float, job: JobView, params: Params) -> float:
    """When the job's queue changes by itself: a running job crosses a threshold, a waiting one is promoted."""
    if job.running:
        ahead = [t for t in params.thresholds if t > job.attained + 1e-9]
        return now + (ahead[0] - job.attained) / job.devices if ahead else float("inf")
    if params.promote > 0 and job.executed > 0:
        return max(now, job.waiting_since + params.promote * job.executed + 1e-6)
    return float("inf")


def gandiva_wakeup(now: float, job: JobView, params: Params) -> float:
    """A running job's turn ends a quantum after it began."""
    return job.slice_start + params.quantum if job.running else float("inf")


POLICIES: dict[str, Policy] = {"fifo": fifo, "srtf": srtf, "tiresias": tiresias, "gandiva": gandiva}
# Besides arrivals and completions, when a policy's decision may change on its own (per job; none: never).
WAKEUPS: dict[str, Callable[[float, JobView, Params], float]] = {"tiresias": tiresias_wakeup,
                                                                 "gandiva": gandiva_wakeup}


@dataclass
class Decision:
    """One decision as data: who starts, who is preempted, who keeps running."""

    time: float
    start: list[str] = field(default_factory=list)
    preempt: list[str] = field(default_factory=list)
    keep: list[str] = field(default_factory=list)


def decide(policy: str, now: float, jobs: list[JobView], devices: int, params: Params = Params()) -> Decision:
    """Run `policy` and check what it returns: known jobs, within the slots."""
    if policy not in POLICIES:

        raise ConfigError(f"--policy {policy!r} is not a policy; choose one of {', '.join(POLICIES)}")
    chosen = POLICIES[policy](now, jobs, devices, params)
    by_id = {j.id: j for j in jobs}
    unknown = chosen - by_id.keys()
    if unknown:
        raise AssertionError(f"policy {policy} chose jobs that are not in the queue: {sorted(unknown)}")
    used = sum(by_id[i].devices for i in chosen)
    if used > devices:
        raise AssertionError(f"policy {policy} gave out {used} slots of {devices}")
    d = Decision(now)
    for j in sorted(jobs, key=lambda j: (j.arrival, j.id)):
        if j.id in chosen:
            (d.keep if j.running else d.start).append(j.id)
        elif j.running:
            d.preempt.append(j.id)
    return d
