"""Keeping a run honest about failure: hangs, mismatched collectives, stragglers and preemption.

Nothing here costs the step a collective or a store round trip:

* Heartbeats: the loop only notes (step, phase) in memory; a background thread writes the latest
  note to the job's key-value store every HEARTBEAT_S, so when a collective times out
  (launch.timeout_s) the rank that noticed can name the ranks that never joined and where they
  were last seen.
* Mismatched collectives (launch.check_collectives): plait.comm.fingerprint compares every
  collective across ranks before it runs; the error names the ranks, both ops and call sites.
* Stragglers: a rank whose compute time per step (its step time minus the time it waited in
  collectives) exceeds 1.5 x the median over a logging window is flagged.
* Preemption: SIGTERM sets a flag; the ranks agree on it in the reduction that a logging step does
  anyway (plait.train.telemetry), write a checkpoint and stop cleanly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import threading
import time

import torch.distributed as dist

from plait import faults
from plait.errors import PlaitError

STRAGGLER_FACTOR = 1.5
PHASES = ("data", "forward_backward", "optimizer", "sync", "checkpoint", "eval")
HEARTBEAT_S = 1.0


class DistributedFailure(PlaitError):
    """A collective timed out or ranks disagreed on one: not the config's fault, so its own exit code."""

    exit_code = 3


def _store():
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


class Watchdog:
    """Heartbeats, SIGTERM/SIGINT and the explanation of a failed collective, for one rank's training loop."""

    def __init__(self, rt, timeout_s: float, comm=None):
        self.rt, self.timeout_s, self.comm = rt, timeout_s, comm
        self.store = _store() if rt.distributed else None
        self.stop_requested = False
        self.stop_signal = ""  # the signal that asked for the stop: SIGTERM or SIGINT
        self.step, self.phase = 0, "data"
        self._prev_handlers: dict = {}
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- heartbeats
    def at(self, step: int, phase: str) -> None:
        """Where this rank is now (a note in memory; the heartbeat thread publishes it)."""
        self.step, self.phase = step, phase

    def _beat(self) -> None:
        sent = None
        while not self._done.wait(HEARTBEAT_S if sent is not None else 0.0):
            now = (self.step, self.phase)
            if now == sent:
                continue
            try:
                self.store.set(f"plait/hb/{self.rt.rank}", json.dumps({"step": now[0], "phase": now[1], "t": time.time()}))
            except Exception:  # the store goes away with the job; a heartbeat must never take the rank down
                return
            sent = now

    def _seen(self) -> dict[int, dict]:
        out = {}
        for r in range(self.rt.world_size):
            try:
                if self.store.check([f"plait/hb/{r}"]):
                    out[r] = json.loads(self.store.get(f"plait/hb/{r}"))
            except Exception:  # the store itself may be going away with the job
                pass
        return out

    def explain(self, exc: BaseException) -> BaseException:
        """Turn a backend error into one that says what happened and who is to blame (or return it as is)."""
        step, phase = self.step, self.phase
        text = str(exc)
        if type(exc).__name__ == "CollectiveMismatch":
            return DistributedFailure(f"rank {self.rt.rank}, step {step} ({phase}): {text}")
        if not re.search(r"[Tt]imed? ?out|timeout", text) or self.store is None:
            return exc
        op = (self.comm.last_call if self.comm is not None else {}).get("op", "a collective")
        seen = self._seen()
        late = []
        for r in range(self.rt.world_size):
            hb = seen.get(r)
            if r == self.rt.rank:
                continue
            if hb is None or (hb["step"], PHASES.index(hb["phase"])) < (step, PHASES.index(phase)):
                where = f"step {hb['step']} ({hb['phase']}), {time.time() - hb['t']:.0f} s ago" if hb else "never"
                late.append(f"rank {r} (last seen: {where})")
        who = "; ".join(late) if late else "no rank is behind by its heartbeat (a network failure?)"
        return DistributedFailure(
            f"rank {self.rt.rank}, step {step} ({phase}): {op} did not finish within launch.timeout_s = "
            f"{self.timeout_s:g} s; did not join: {who}"
        )

    # ---- the loop's lifetime: heartbeats and SIGTERM
    def __enter__(self) -> Watchdog:
        if self.store is not None:
            self._thread = threading.Thread(target=self._beat, name="plait-heartbeat", daemon=True)
            self._thread.start()
        if threading.current_thread() is threading.main_thread():

            def handler(signum, frame):
                if signum == signal.SIGINT and self.stop_signal == "SIGINT":
                    os._exit(128 + signal.SIGINT)  # a second Ctrl-C: stop at once
                if self.stop_requested:
                    return
                self.stop_requested, self.stop_signal = True, signal.Signals(signum).name
                faults.STOP.set()  # a fault that waits for the stop (`until=stop`) lets the step finish
                # A rank stuck in a collective never reaches the end of its step: do not outlive the grace period.
                t = threading.Timer(self.timeout_s, lambda: os._exit(128 + signum))
                t.daemon = True
                t.start()

            # SIGTERM (from torchrun's agent, Slurm, Kubernetes) and SIGINT (Ctrl-C, forwarded by plait's launcher)
            # ask for a clean stop at the next logging step: every rank agrees on it, the job checkpoints and exits 0.
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._prev_handlers[sig] = signal.signal(sig, handler)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._done.set()
        for sig, prev in self._prev_handlers.items():
            signal.signal(sig, prev)
        self._prev_handlers = {}
        if exc is not None and isinstance(exc, Exception):
            explained = self.explain(exc)
            if explained is not exc:
                raise explained from None


def stragglers(compute_s: list[float]) -> list[int]:
    """Ranks whose compute time is above STRAGGLER_FACTOR x the median of all ranks."""
    if len(compute_s) < 2:
        return []
    med = statistics.median(compute_s)
    return [r for r, t in enumerate(compute_s) if med > 0 and t > STRAGGLER_FACTOR * med]
