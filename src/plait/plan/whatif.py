"""`plait whatif RUN --change ...`: what an optimization would save, predicted from a profiled step without running it.

Daydream (Zhu et al. 2020) in plait's terms. A run trained with `log.profile_steps` has a Chrome trace per rank
(torch.profiler, RUN_DIR/traces/rank<r>.json). From it, `Step.from_trace` builds one step's dependency graph:

* the main thread's top-level operations in order, each with its duration and the gap before it (Python and
  dispatch time between operations), in phases: forward (up to the first autograd function), backward (the
  autograd functions), optimizer (the rest: clipping, Optimizer.step, zero_grad);
* the collectives (gloo:* / nccl:* on communication threads), each issued from the operation running when it
  started; those of one thread run one after another;
* waits: the first operation that starts after a collective ended depends on it (DDP's end of backward waits for
  its last all-reduce). The idle time before it is not work: it is replaced by the dependency.

`simulate` replays the graph (the unchanged graph gives the traced step back exactly) and a change rewrites the
graph first:

    allreduce=2x       every collective takes half as long (a faster network)
    compression=fp16   all-reduces move half the bytes (bf16 too), taken as half their time; the casts are not counted
    zero=1             plait's ZeRO-1 instead of DDP: no overlap; a reduce-scatter (half an all-reduce) after backward,
                       Optimizer.step over 1/dp of the parameters, an all-gather (half an all-reduce) after it
    fuse_optimizer     Optimizer.step as one fused kernel: its operations' work without each one's dispatch cost (the
                       trace's median trivial operation) or the Python time between them
    checkpointing      activation checkpointing: the model's forward is computed again before its backward

The prediction is the traced step time scaled by simulate(changed) / simulate(unchanged), averaged over the traced
steps. benchmarks/whatif.py checks predictions against running the changed job.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from plait.errors import ConfigError

CHANGES = ("allreduce=<F>x", "compression=fp16", "compression=bf16", "zero=1", "fuse_optimizer", "checkpointing")
TRIVIAL = ("aten::detach", "detach", "aten::as_strided", "aten::view", "aten::t", "aten::transpose", "aten::expand",
           "aten::empty", "aten::unsqueeze", "aten::resolve_conj", "aten::alias")
COMM_PREFIXES = ("gloo:", "nccl:")


@dataclass
class Task:
    name: str
    dur: float  # microseconds
    gap: float  # idle main-thread time before it when it waits on nothing
    phase: str  # forward, backward or optimizer
    waits: list[int] = field(default_factory=list)  # collectives it depends on
    resume: float = 0.0  # time from the last collective it waits on to its start
    children: list[float] = field(default_factory=list)  # durations of its direct sub-operations (Optimizer.step)


@dataclass
class Comm:
    name: str
    dur: float
    issuer: int  # the main task it was issued from (or the last one before the gap it was issued in)
    offset: float  # from the issuer's start; issued in the gap after it: from the issuer's end
    within: bool = True
    lane: int = 0  # the thread it ran on: collectives of one thread run one after another


@dataclass
class Step:
    tasks: list[Task]
    comms: list[Comm]
    trivial: float  # the median duration of an operation that does no work: one dispatch
    tail: list[int] = field(default_factory=list)  # collectives the next step waits for (ZeRO-1's all-gather)

    @classmethod
    def from_trace(cls, path: Path | str) -> list[Step]:
        """The steps of a trace (each ends at an Optimizer.zero_grad; a trace of one step: all of it)."""
        events = [e for e in json.loads(Path(path).read_text()).get("traceEvents", [])
                  if e.get("ph") == "X" and isinstance(e.get("pid"), int)]
        if not events:
            raise ConfigError(f"{path} has no profiled operations; train with --set log.profile_steps=[5,5]")
        steps_at = [e for e in events if str(e["name"]).startswith("Optimizer.step")]
        main = steps_at[0]["tid"] if steps_at else max({e["tid"] for e in events}, key=lambda t: sum(
            e["tid"] == t for e in events))
        ops = sorted((e for e in events if e["tid"] == main), key=lambda e: (e["ts"], -e["dur"]))
        top: list[dict] = []
        kids: dict[int, list[float]] = {}
        for e in ops:
            if top and e["ts"] < top[-1]["ts"] + top[-1]["dur"]:
                parent = top[-1]
                if e["ts"] >= parent.get("_kid_end", 0):  # a direct child of the top-level operation
                    kids.setdefault(len(top) - 1, []).append(e["dur"])
                    parent["_kid_end"] = e["ts"] + e["dur"]
                continue
            top.append(dict(e))
        comms = sorted((e for e in events if e["tid"] != main and str(e["name"]).startswith(COMM_PREFIXES)),
                       key=lambda e: e["ts"])
        trivial = statistics.median([e["dur"] for e in ops if e["name"] in TRIVIAL] or [1.0])
        cuts = [i for i, e in enumerate(top) if str(e["name"]).startswith("Optimizer.zero_grad")] or [len(top) - 1]
        out, lo = [], 0
        for hi in cuts:
            out.append(_step(top[lo:hi + 1], {k - lo: v for k, v in kids.items() if lo <= k <= hi}, comms, trivial))
            lo = hi + 1
        return out


def _step(top: list[dict], kids: dict[int, list[float]], comms_all: list[dict], trivial: float) -> Step:
    start, end = top[0]["ts"], top[-1]["ts"] + top[-1]["dur"]
    comms = [c for c in comms_all if start <= c["ts"] < end]
    backward = [i for i, e in enumerate(top) if str(e["name"]).startswith("autograd::engine::evaluate_function")]
    b0, b1 = (backward[0], backward[-1]) if backward else (len(top), len(top) - 1)
    tasks = []
    for i, e in enumerate(top):
        phase = "forward" if i < b0 else "backward" if i <= b1 else "optimizer"
        gap = e["ts"] - (top[i - 1]["ts"] + top[i - 1]["dur"]) if i else 0.0
        tasks.append(Task(str(e["name"]), float(e["dur"]), float(gap), phase, children=kids.get(i, [])))
    out = []
    for c in comms:
        issuer = max(i for i, e in enumerate(top) if e["ts"] <= c["ts"])
        offset, within = float(c["ts"] - top[issuer]["ts"]), c["ts"] <= top[issuer]["ts"] + top[issuer]["dur"]
        out.append(Comm(str(c["name"]), float(c["dur"]), issuer, offset if within else offset - top[issuer]["dur"],
                        within, int(c["tid"])))
        done = c["ts"] + c["dur"]
        waiter = next((i for i, e in enumerate(top) if e["ts"] >= done - 1e-3), None)
        if waiter is None:
            continue
        t = tasks[waiter]
        t.waits.append(len(out) - 1)
        t.resume = float(top[waiter]["ts"] - done)
        prev_end = top[waiter - 1]["ts"] + top[waiter - 1]["dur"] if waiter else start
        if prev_end < done:  # the main thread sat idle for it: that was waiting, not work
            t.gap = t.resume
    return Step(tasks, out, trivial)


def simulate(step: Step) -> float:
    """The step's time (microseconds) when its tasks and collectives run by their dependencies."""
    ends: list[float] = []
    comm_end: list[float | None] = [None] * len(step.comms)
    by_issuer: dict[int, list[int]] = {}
    for k, c in enumerate(step.comms):
        by_issuer.setdefault(c.issuer, []).append(k)
    lane_free: dict[int, float] = {}
    t = 0.0
    for i, task in enumerate(step.tasks):
        start = t + task.gap
        for k in task.waits:
            done = comm_end[k]
            if done is not None:
                start = max(start, done + task.resume)
        t = start + task.dur
        ends.append(t)
        for k in by_issuer.get(i, []):
            c = step.comms[k]
            begin = max(start + min(c.offset, task.dur) if c.within else t + c.offset, lane_free.get(c.lane, 0.0))
            comm_end[k] = lane_free[c.lane] = begin + c.dur
    return max([t, *[comm_end[k] or 0.0 for k in step.tail]])  # a collective still in flight overlaps the next step


def parse_change(text: str) -> str:
    key, _, value = text.partition("=")
    ok = (key == "allreduce" and value.endswith("x") and _positive(value[:-1])) or text in CHANGES
    if not ok:
        raise ConfigError(f"--change {text!r} is not a change plait can simulate; use one of {', '.join(CHANGES)}")
    return text


def _positive(s: str) -> bool:
    try:
        return float(s) > 0
    except ValueError:
        return False


def apply(step: Step, change: str, dp: int) -> Step:
    """The step's graph with the change made (a copy)."""
    s = dataclasses.replace(step, tasks=[dataclasses.replace(t, waits=list(t.waits)) for t in step.tasks],
                            comms=[dataclasses.replace(c) for c in step.comms], tail=list(step.tail))
    key, _, value = change.partition("=")
    if key == "allreduce":
        for c in s.comms:
            c.dur /= float(value[:-1])
    elif key == "compression":
        for c in s.comms:
            c.dur *= 0.5 if "all_reduce" in c.name or "allreduce" in c.name else 1.0
    elif change == "fuse_optimizer":
        for t in s.tasks:
            if t.name.startswith("Optimizer.step") and t.children:
                t.dur = s.trivial + sum(max(0.0, d - s.trivial) for d in t.children)
    elif change == "checkpointing":
        _recompute(s)
    elif change == "zero=1":
        _zero_one(s, dp)
    return s


def _recompute(s: Step) -> None:
    """The model's forward (the largest forward task: the model's module; the loss and data moves are not redone)
    runs again at the start of backward."""
    forward = [t for t in s.tasks if t.phase == "forward"]
    first = next((i for i, t in enumerate(s.tasks) if t.phase == "backward"), None)
    if not forward or first is None:
        return
    model = max(forward, key=lambda t: t.dur)
    s.tasks.insert(first, Task("recompute forward", model.dur, 0.0, "backward"))
    for c in s.comms:
        c.issuer += c.issuer >= first


def _zero_one(s: Step, dp: int) -> None:
    """DDP's overlapped all-reduces -> ZeRO-1: reduce-scatter after backward, the step on 1/dp, all-gather after."""
    total = sum(c.dur for c in s.comms if "all_reduce" in c.name or "allreduce" in c.name)
    if not total:
        raise ConfigError("--change zero=1 replaces DDP's all-reduces; this trace has none (is the run already sharded, "
                          "or on one process?)")
    for t in s.tasks:
        t.waits = []
        if t.name.startswith("Optimizer.step"):
            t.dur /= dp
    last_bwd = max((i for i, t in enumerate(s.tasks) if t.phase == "backward"), default=0)
    step_at = next((i for i, t in enumerate(s.tasks) if t.name.startswith("Optimizer.step")), len(s.tasks) - 1)
    s.comms = [Comm("reduce_scatter", total / 2, last_bwd, s.tasks[last_bwd].dur),
               Comm("all_gather", total / 2, step_at, s.tasks[step_at].dur)]
    if last_bwd + 1 < len(s.tasks):
        nxt = s.tasks[last_bwd + 1]
        nxt.waits, nxt.resume = [0], nxt.gap
    s.tail = [1]  # the next forward needs the gathered parameters


def predict(run_dir: Path, changes: list[str], rank: int = 0) -> dict:
    """{change: {"predicted_s", "ratio"}} and the traced step: the traced time times simulate(changed) / simulate()."""
    trace = Path(run_dir) / "traces" / f"rank{rank}.json"
    if not trace.is_file():
        raise ConfigError(f"{trace} is missing: train with --set log.profile_steps=[5,5] (a step after warm-up) to "
                          "record the trace plait whatif reads")
    steps = Step.from_trace(trace)
    cfg_file = Path(run_dir) / "config.toml"
    dp = _dp(cfg_file)
    base = [simulate(s) for s in steps]
    measured = statistics.mean(base) / 1e6
    out: dict = {"traced_step_s": measured, "steps": len(steps), "dp": dp, "changes": {}}
    for change in changes:
        ratio = statistics.mean(simulate(apply(s, parse_change(change), dp)) / b for s, b in zip(steps, base))
        out["changes"][change] = {"predicted_s": measured * ratio, "ratio": ratio}
    return out


def _dp(cfg_file: Path) -> int:
    import tomllib

    if not cfg_file.is_file():
        return 1
    return int(tomllib.loads(cfg_file.read_text()).get("parallel", {}).get("dp", 1))


def cmd_whatif(a) -> int:
    """`plait whatif`'s verb (its parser: plait.plan.cli)."""
    got = predict(a.run_dir, a.change, a.rank)
    print(f"traced step: {got['traced_step_s'] * 1e3:.2f} ms (mean of {got['steps']} profiled steps, rank {a.rank})")
    print(f"{'change':<20} {'predicted ms':>12} {'vs traced':>9}")
    for change, p in got["changes"].items():
        print(f"{change:<20} {p['predicted_s'] * 1e3:>12.2f} {p['ratio']:>8.3f}x")
    return 0
