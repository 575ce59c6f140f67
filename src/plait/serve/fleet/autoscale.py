"""`--autoscale MIN:MAX`: replicas that follow the load, down to zero.

Two parts. `AutoscalePolicy` is pure: it is fed (time, ongoing requests) samples and asked for a
decision at a time, with the current replica count; it returns a `Decision` (data) and touches no
process or clock of its own, so tests drive it with a fake clock. `Autoscaler` is the controller:
every TICK_S it samples the service's ongoing requests (queued + running), asks the policy, and
tells the replica pool to start or stop processes to match.

The policy (after Ray Serve's autoscaler and Knative's stable/panic windows):

  load        = mean ongoing requests over the last `look_back_s` (the stable window)
  proposal    = ceil(load / target_ongoing), clamped to [MIN, MAX]; at least 1 while any request is
                ongoing or while traffic was seen within `scale_to_zero_after_s` (0 needs MIN = 0)
  cold start  = from 0 replicas, a waiting request starts one at once (no delay): it is held meanwhile
  panic       = ongoing now >= PANIC x target x current: scale up at once to ceil(now / target)
  upscale     = to the smallest proposal of the last `upscale_delay_s`, when that is above the count
  downscale   = to the largest proposal of the last `downscale_delay_s`, when that is below the count
  to zero     = no request for `scale_to_zero_after_s` (and MIN = 0)

The two windows are Kubernetes' HPA stabilisation windows: a short spike does not scale up unless it
lasts the upscale delay, and one busy moment within the downscale delay keeps the replicas, so a
load that flaps changes nothing. The count never leaves [MIN, MAX].
"""

from __future__ import annotations

import asyncio
import collections
import math
import sys
import time
from dataclasses import dataclass

from plait.serve.errors import ServeError

TICK_S = 0.1  # how often the controller samples and decides
PANIC = 2.0  # ongoing requests beyond PANIC x target per replica: scale up without waiting


@dataclass(frozen=True)
class AutoscaleConfig:
    min_replicas: int = 1
    max_replicas: int = 4
    target_ongoing: float = 2.0  # ongoing requests per replica the policy aims at
    upscale_delay_s: float = 1.0
    downscale_delay_s: float = 10.0
    scale_to_zero_after_s: float = 30.0
    look_back_s: float = 2.0

    @staticmethod
    def parse(text: str) -> tuple[int, int]:
        """--autoscale MIN:MAX."""
        lo, sep, hi = text.partition(":")
        if not sep or not lo.strip().isdigit() or not hi.strip().isdigit():
            raise ServeError(f"--autoscale {text!r} must be MIN:MAX, two integers, e.g. 0:4")
        return int(lo), int(hi)

    def validate(self) -> AutoscaleConfig:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ServeError(f"--autoscale {self.min_replicas}:{self.max_replicas}: need 0 <= MIN <= MAX and MAX >= 1")
        for flag, value in (("--target-ongoing", self.target_ongoing), ("--upscale-delay-s", self.upscale_delay_s),
                            ("--downscale-delay-s", self.downscale_delay_s),
                            ("--scale-to-zero-after-s", self.scale_to_zero_after_s)):
            if not math.isfinite(value) or value < 0 or (flag == "--target-ongoing" and value == 0):
                raise ServeError(f"{flag} = {value} must be a finite number " + ("> 0" if flag == "--target-ongoing"
                                                                                  else ">= 0"))
        return self


@dataclass(frozen=True)
class Decision:
    t: float
    current: int
    desired: int
    proposal: int  # what the load alone asks for (before the delays)
    load: float  # mean ongoing requests over the look-back window
    reason: str  # steady | cold-start | panic | upscale | downscale | scale-to-zero | wait-upscale | wait-downscale


class AutoscalePolicy:
    def __init__(self, cfg: AutoscaleConfig):
        self.cfg = cfg
        self._samples: collections.deque[tuple[float, float]] = collections.deque()
        self._proposals: collections.deque[tuple[float, int]] = collections.deque()
        self._last_busy: float | None = None  # when a request was last ongoing

    def observe(self, t: float, ongoing: float) -> None:
        self._samples.append((t, ongoing))
        if ongoing > 0:
            self._last_busy = t
        while self._samples and self._samples[0][0] < t - self.cfg.look_back_s - 1e-9:
            self._samples.popleft()

    def _stable(self, t: float, delay: float, pick) -> int | None:
        """min (upscale) or max (downscale) of the proposals over the last `delay` seconds, once that long is seen."""
        if not self._proposals or self._proposals[0][0] > t - delay + 1e-9:
            return None
        return pick(p for s, p in self._proposals if s >= t - delay - 1e-9)

    def decide(self, t: float, current: int) -> Decision:
        c = self.cfg
        now = self._samples[-1][1] if self._samples else 0.0
        load = sum(v for _, v in self._samples) / len(self._samples) if self._samples else 0.0
        proposal = math.ceil(load / c.target_ongoing - 1e-9)
        if now > 0 or (self._last_busy is not None and t - self._last_busy < c.scale_to_zero_after_s):
            proposal = max(proposal, 1)
        proposal = min(max(proposal, c.min_replicas), c.max_replicas)
        self._proposals.append((t, proposal))
        horizon = max(c.upscale_delay_s, c.downscale_delay_s) + 1.0  # one proposal older than the window is kept
        while len(self._proposals) > 1 and self._proposals[1][0] < t - horizon:
            self._proposals.popleft()

        def out(desired: int, reason: str) -> Decision:
            return Decision(t, current, desired, proposal, load, reason)

        if current == 0 and now > 0:
            return out(max(proposal, 1), "cold-start")
        if current > 0 and current < c.max_replicas and now >= PANIC * c.target_ongoing * current:
            return out(min(c.max_replicas, max(proposal, math.ceil(now / c.target_ongoing))), "panic")
        if proposal == 0 and current > 0:  # idle for scale_to_zero_after_s: that was the wait
            return out(0, "scale-to-zero")
        up = self._stable(t, c.upscale_delay_s, min)
        if up is not None and up > current:
            return out(up, "upscale")
        down = self._stable(t, c.downscale_delay_s, max)
        if down is not None and down < current:
            return out(down, "downscale")
        if proposal != current:
            return out(current, "wait-upscale" if proposal > current else "wait-downscale")
        return out(current, "steady")


class Autoscaler:
    """The controller: samples `ongoing()` every TICK_S and scales `pool` (a ReplicaPool) to the policy's decision."""

    def __init__(self, cfg: AutoscaleConfig, pool, ongoing, metrics=None, clock=time.monotonic):
        self.policy = AutoscalePolicy(cfg)
        self.pool, self.ongoing, self.metrics, self.clock = pool, ongoing, metrics, clock
        self.desired = cfg.min_replicas
        self.history: collections.deque[Decision] = collections.deque(maxlen=10_000)  # changes only
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def tick(self) -> Decision:
        t = self.clock()
        self.policy.observe(t, self.ongoing())
        d = self.policy.decide(t, self.pool.target)
        if d.desired != self.pool.target:
            print(f"autoscale: {d.current} -> {d.desired} replicas ({d.reason}; {d.load:.2f} ongoing on average, "
                  f"{d.proposal} proposed)", file=sys.stderr, flush=True)
            self.history.append(d)
            self.pool.scale_to(d.desired)
        self.desired = d.desired
        if self.metrics is not None:
            self.metrics.replicas_desired.set(d.desired)
        return d

    def wake(self) -> None:
        """A request arrived with no replica up: decide now rather than at the next tick."""
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self.tick()
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            except TimeoutError:
                pass

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
