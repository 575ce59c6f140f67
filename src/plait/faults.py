"""Failure injection for tests and the chaos benchmark: fail a chosen rank at a chosen step.

    PLAIT_FAULTS="kill:rank=1:step=7"                      SIGKILL rank 1 as step 7 begins
    PLAIT_FAULTS="kill:rank=0:step=10:at=publish"          ... while checkpoint 10 is being published
    PLAIT_FAULTS="stall:rank=1:step=3:seconds=30"          rank 1 sleeps (a hang, for timeout tests)
    PLAIT_FAULTS="stall:step=5:until=/tmp/go:seconds=120"  every rank waits at step 5 until /tmp/go exists (at most
                                                           120 s): a test's window to act mid-run, whatever the load
    PLAIT_FAULTS="stall:step=2:world=1:until=stop"         a job of 1 rank waits at step 2 until it is asked to stop
                                                           (SIGTERM: a node joined and the agent re-forms the job)
    PLAIT_FAULTS="slow:rank=1:seconds=0.05"                rank 1 sleeps every step (a straggler)
    PLAIT_FAULTS="slow:seconds=0.1:at=data"                every rank waits 0.1 s for each batch (input-bound)
    PLAIT_FAULTS="slow:rank=1:factor=3"                    rank 1's forward/backward takes 3x as long (it sleeps twice
                                                           the compute it just did: a slower device, whatever its share)
    PLAIT_FAULTS="slow:seconds=0.02:at=comm"               every collective takes 20 ms longer (a slow link)
    PLAIT_FAULTS="mismatch:rank=1:step=3"                  rank 1 issues a broadcast on the dp group the others do not
    PLAIT_FAULTS="sigterm:rank=0:step=5"                   the job is asked to stop (as on preemption)

Several faults are separated by ';'. A fault fires in the first incarnation of the workers only
(TORCHELASTIC_RESTART_COUNT, or PLAIT_RESTART_COUNT under Ray, = 0) unless it says `always=1`, so a restarted job can succeed.
Nothing happens when the variable is unset.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from plait.callback import Callback

# Set when this process is asked to stop (plait.train.watchdog's SIGTERM/SIGINT handler): what `until=stop` waits for.
STOP = threading.Event()


def parse(text: str) -> list[dict]:
    faults = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kind, *fields = part.split(":")
        f = {"kind": kind, "at": "step"}
        for item in fields:
            key, _, value = item.partition("=")
            f[key] = value
        faults.append(f)
    return faults


def _active() -> list[dict]:
    text = os.environ.get("PLAIT_FAULTS", "")
    if not text:
        return []
    # torchrun's agent counts restarts; plait's Ray launcher says so in PLAIT_RESTART_COUNT
    first = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("PLAIT_RESTART_COUNT", "0"))) == 0
    return [f for f in parse(text) if first or f.get("always") == "1"]


def maybe_fire(point: str, rank: int, step: int, group=None) -> None:
    """Called at `point`: "step" (a step begins), "data" (its batch is fetched), "publish" (a checkpoint is
    being published) or "comm" (a collective is entered; step -1, so only faults without a step fire).

    group: the process group a "mismatch" fault issues its stray collective on (the caller's dp group).
    """
    for f in _active():
        if f["at"] != point or int(f.get("rank", rank)) != rank or "factor" in f:
            continue
        if "step" in f and int(f["step"]) != step:
            continue
        if "world" in f and int(os.environ.get("WORLD_SIZE", "1")) != int(f["world"]):
            continue
        kind = f["kind"]
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind in ("stall", "slow") and "until" in f:
            deadline = time.monotonic() + float(f.get("seconds", 3600))
            done = STOP.is_set if f["until"] == "stop" else (lambda path=f["until"]: os.path.exists(path))
            while not done() and time.monotonic() < deadline:
                time.sleep(0.05)
        elif kind in ("stall", "slow"):
            time.sleep(float(f.get("seconds", 3600)))
        elif kind == "sigterm":
            os.kill(os.getppid() if f.get("target") == "agent" else os.getpid(), signal.SIGTERM)
        elif kind == "mismatch":
            import torch
            import torch.distributed as dist

            dist.broadcast(torch.zeros(3), dist.get_global_rank(group, 0) if group is not None else 0, group=group)


def slow_compute(rank: int, seconds: float) -> float:
    """After a rank's forward/backward of `seconds`: a `slow:...:factor=F` fault makes it last F times as long.
    Returns the seconds slept (0 without the fault)."""
    slept = 0.0
    for f in _active():
        if f["kind"] == "slow" and "factor" in f and int(f.get("rank", rank)) == rank:
            pause = max(0.0, float(f["factor"]) - 1.0) * max(0.0, seconds)
            time.sleep(pause)
            slept += pause
    return slept


class SlowDevice(Callback):
    """The `slow:...:factor=F` fault in the training loop: this rank's forward/backward lasts F times as long."""

    def __init__(self, rank: int):
        self.rank = rank

    def after_compute(self, step: int, seconds: float, samples: int) -> float:
        return slow_compute(self.rank, seconds)
