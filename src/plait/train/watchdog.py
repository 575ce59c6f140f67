"""Keeping a run honest about failure: hangs, mismatched collectives, stragglers and preemption.

* Heartbeats: each rank writes (step, phase, time) to the job's key-value store as it goes, so
  when a collective times out (launch.timeout_s) the rank that noticed can name the ranks that
  never joined and where they were last seen.
* Mismatched collectives (launch.check_collectives): plait.comm.fingerprint compares every
  collective across ranks before it runs; the error names the ranks, both ops and call sites.
* Stragglers: a rank whose compute time per step (its step time minus the time it waited in
  collectives) exceeds 1.5 x the median over a logging window is flagged.
* Preemption: SIGTERM sets a flag; the ranks agree on it at the end of a step (one all-reduce),
  write a checkpoint and stop cleanly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import time

import torch
import torch.distributed as dist

from plait.comm import accounting
from plait.errors import PlaitError

STRAGGLER_FACTOR = 1.5
PHASES = ("data", "forward_backward", "optimizer", "sync", "checkpoint", "eval")


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
    def __init__(self, rt, timeout_s: float):
        self.rt, self.timeout_s = rt, timeout_s
        self.store = _store() if rt.distributed else None
        self.stop_requested = False
        self._prev_handler = None

    # ---- heartbeats
    def beat(self, step: int, phase: str) -> None:
        if self.store is not None:
            self.store.set(f"plait/hb/{self.rt.rank}", json.dumps({"step": step, "phase": phase, "t": time.time()}))

    def _seen(self) -> dict[int, dict]:
        out = {}
        for r in range(self.rt.world_size):
            try:
                if self.store.check([f"plait/hb/{r}"]):
                    out[r] = json.loads(self.store.get(f"plait/hb/{r}"))
            except Exception:  # the store itself may be going away with the job
                pass
        return out

    def explain(self, exc: BaseException, step: int, phase: str) -> BaseException:
        """Turn a backend error into one that says what happened and who is to blame (or return it as is)."""
        text = str(exc)
        if type(exc).__name__ == "CollectiveMismatch":
            return DistributedFailure(f"rank {self.rt.rank}, step {step} ({phase}): {text}")
        if not re.search(r"[Tt]imed? ?out|timeout", text) or self.store is None:
            return exc
        op = accounting.last_call.get("op", "a collective")
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

    # ---- preemption
    def install_sigterm(self) -> None:
        """SIGTERM (from torchrun's agent, Slurm, Kubernetes) asks for a clean stop after the current step."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            self.stop_requested = True
            # A rank stuck in a collective never reaches the end of its step: do not outlive the grace period.
            t = threading.Timer(self.timeout_s, lambda: os._exit(128 + signal.SIGTERM))
            t.daemon = True
            t.start()

        self._prev_handler = signal.signal(signal.SIGTERM, handler)

    def restore_sigterm(self) -> None:
        if self._prev_handler is not None:
            signal.signal(signal.SIGTERM, self._prev_handler)
            self._prev_handler = None

    def should_stop(self) -> bool:
        """Whether any rank was asked to stop (a collective: every rank calls it at the end of every step)."""
        if not self.rt.distributed:
            return self.stop_requested
        flag = torch.tensor([1.0 if self.stop_requested else 0.0], device=self.rt.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def stragglers(compute_s: list[float]) -> list[int]:
    """Ranks whose compute time is above STRAGGLER_FACTOR x the median of all ranks."""
    if len(compute_s) < 2:
        return []
    med = statistics.median(compute_s)
    return [r for r, t in enumerate(compute_s) if med > 0 and t > STRAGGLER_FACTOR * med]
