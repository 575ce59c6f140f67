"""Asynchronous decentralized SGD, AD-PSGD (`parallel.sync = 'gossip'` + `parallel.gossip_async = true`).

Lian et al. 2018, "Asynchronous Decentralized Parallel Stochastic Gradient Descent": each rank steps
on its own gradient and, after its step, averages its parameters with one randomly chosen neighbour,
with no global barrier: a slow rank delays only the exchanges that pick it, and those only by the
time it takes to answer, not by its compute. The exchange is atomic per pair: both ranks end with
(x_a + x_p) / 2 of their parameters at that moment.

How it is done on gloo, which has no one-sided operations (the paper's bipartite split):

* Ranks are active (even dp rank) or passive (odd). Only an active rank starts an exchange, only a
  passive one answers, so no two ranks ever wait on each other and two ranks cannot pick each other.
  The graph is the topology's with every edge joining an active and a passive rank: ring i +- 1;
  exponential i +- 1 and i +- (2^k + 1) (the exponential graph's offsets made odd). dp must be even.
* Every passive rank runs a server thread on a process group of its own (gloo, CPU copies of the
  parameters, so the same code runs beside NCCL). It receives a request from any source
  (`dist.recv` without `src`), one at a time, which is what makes each exchange atomic. While it
  runs, the rank's GIL switch interval is 0.5 ms (not 5): the answer waits for the GIL, and a busy
  owner hands it over only every interval (this took a small model's exchange from 8 to 2 ms).
* An active rank, after its optimizer step, sends (its step, its flat parameters) to a neighbour
  drawn at random (seeded by train.seed and the rank), receives the average and the neighbour's step,
  and copies the average into its parameters.
* The server never writes the model: it reads it under a lock (held by the owner only around its
  optimizer step) and keeps the decided average as pending, with the parameters it was decided on.
  The owner applies it at its next safe point (before forward, after its optimizer step, before any
  read) as average + (what its own step changed since): the paper's x_p <- avg(x_a, x_p) - lr * g,
  where g was computed on the parameters before the average. Forward and backward never see a
  tensor change under them.
* A clean end: an active rank that has finished its steps says goodbye to each neighbour and waits
  for the answer; a passive rank's server stops once every active neighbour has said goodbye, and
  the rank's `finish` waits for that. Ranks may finish their steps at any time apart.

Staleness is how many steps apart the two ranks were when they averaged, |steps_a - steps_p|, each
counting its own optimizer steps. metrics.jsonl gets `staleness_mean`, `staleness_max` and
`exchanges` (over the window, every active rank's) with `consensus_distance`; summary.json's
`gossip` has each rank's exchanges, the staleness histogram and each rank's own steps per second.
What is not asynchronous: plait's logging steps (log.every; an all-gather of the loss), evaluation
and checkpoints are collectives, so no rank runs more than log.every steps ahead of another.

Checkpoints hold the ranks' average model, taken after a barrier (no exchange in flight), and rank
0's optimizer state, as synchronous gossip does. A resumed run starts every rank from that average
at the checkpoint's step; which pairs averaged when is decided by timing and is not replayed, so a
resumed run is a valid AD-PSGD run from that point, not the uninterrupted one's trajectory (two
uninterrupted runs do not agree with each other either).
"""

from __future__ import annotations

import datetime
import random
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from plait.comm import accounting
from plait.comm.algorithms import group_ranks
from plait.parallel.base import Strategy
from plait.parallel.gossip import GossipStrategy, consensus_distance
from plait.parallel.keys import GossipKeys
from plait.parallel.scheme import Build

BYE, REQUEST = 0, 1
TAG_HEADER, TAG_PARAMS, TAG_REPLY_HEADER, TAG_REPLY = 71, 72, 73, 74
SWITCH_INTERVAL_S = 0.0005  # a passive rank's GIL switch interval while its server thread runs


def async_offsets(n: int, topology: str) -> list[int]:
    """Offsets d (mod n, all odd) such that active rank i averages with passive ranks i + d."""
    if n < 2 or n % 2:
        raise ValueError(f"AD-PSGD's active/passive split needs an even number of ranks, not {n}")
    if topology == "ring":
        base = [1]
    elif topology == "exponential":
        base = [1] + [(1 << k) + 1 for k in range(1, max(1, (n - 1).bit_length())) if (1 << k) + 1 < n]
    else:
        raise ValueError(f"unknown gossip topology {topology!r}; choose ring or exponential")
    return sorted({d % n for b in base for d in (b, -b)})


class PairAverager:
    """One rank's side of AD-PSGD's pairwise averages of `tensors` over `group` (see the module docstring).

    Active ranks call `exchange(step)`; passive ranks `start()` a server thread. The owner of the
    tensors holds `lock` while it changes them and calls `apply_pending()` at its safe points.
    `close()` ends the exchanges on both sides (every rank of the group calls it once).
    """

    def __init__(self, tensors: list[torch.Tensor], group, topology: str, seed: int, timeout_s: float = 300.0):
        self.tensors, self.group, self.timeout_s = tensors, group, timeout_s
        ranks = group_ranks(group)
        n, i = len(ranks), ranks.index(dist.get_rank())
        self.active = i % 2 == 0
        self.neighbours = sorted({ranks[(i + d) % n] for d in async_offsets(n, topology)})
        self.rng = random.Random(seed * 1_000_003 + dist.get_rank())
        self.lock = threading.Lock()
        self.steps = 0  # the owner's optimizer steps (set by it under the lock)
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (average, the flat parameters it was decided on)
        self.exchanges = self.served = 0
        self.staleness: list[int] = []  # of every exchange this (active) rank made
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # ---- the parameters, flat and on the CPU (the exchange group is gloo whatever the device)
    def _flat(self) -> torch.Tensor:
        return _flatten_dense_tensors([t.detach() for t in self.tensors]).cpu()

    def _write(self, flat: torch.Tensor) -> None:
        for t, new in zip(self.tensors, _unflatten_dense_tensors(flat, self.tensors)):
            t.detach().copy_(new)

    def _current(self, flat: torch.Tensor | None = None) -> torch.Tensor:
        """The parameters as the next exchange sees them: the pending average plus the owner's changes since
        (flat: the tensors flattened, if the caller has them)."""
        flat = self._flat() if flat is None else flat
        if self.pending is None:
            return flat
        avg, base = self.pending
        return avg + (flat - base) if not torch.equal(flat, base) else avg.clone()

    def apply_pending(self) -> None:
        """Write the pending average (plus the owner's own changes since) into the tensors; call under `lock`."""
        if self.pending is not None:
            self._write(self._current())
            self.pending = None

    # ---- the active side
    def exchange(self, step: int) -> int:
        """Average with a random neighbour; both end with the mean. Returns the staleness (steps apart)."""
        peer = self.rng.choice(self.neighbours)
        with self.lock:
            self.apply_pending()
            mine = self._flat()
        dist.send(torch.tensor([REQUEST, step]), peer, group=self.group, tag=TAG_HEADER)
        dist.send(mine, peer, group=self.group, tag=TAG_PARAMS)
        theirs = torch.empty(1, dtype=torch.int64)
        dist.recv(theirs, peer, group=self.group, tag=TAG_REPLY_HEADER)
        avg = torch.empty_like(mine)
        dist.recv(avg, peer, group=self.group, tag=TAG_REPLY)
        with self.lock:
            self._write(avg)
        self.exchanges += 1
        stale = abs(step - int(theirs))
        self.staleness.append(stale)
        return stale

    # ---- the passive side
    def start(self) -> None:
        if not self.active:
            # The server answers only once it holds the GIL, which a busy owner hands over every switch interval
            # (5 ms by default, longer than a small model's exchange): ask for it more often while serving.
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
            self._thread = threading.Thread(target=self._serve, name="plait-adpsgd", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        # The bytes this thread sends are this rank's traffic, but its waits are not the owner's: the step's comm
        # wait (and what a slow-device fault and hetero take for compute, the step minus that wait) stays the owner's.
        accounting._local.caller_waits = True
        try:
            waiting = set(self.neighbours)  # active neighbours that have not said goodbye
            header = torch.empty(2, dtype=torch.int64)
            while waiting:
                src = dist.recv(header, group=self.group, tag=TAG_HEADER)  # from any active neighbour
                kind, _their_step = header.tolist()
                if kind == BYE:
                    waiting.discard(src)
                    dist.send(torch.tensor([self.steps]), src, group=self.group, tag=TAG_REPLY_HEADER)
                    continue
                theirs = torch.empty(sum(t.numel() for t in self.tensors), dtype=self.tensors[0].dtype)
                dist.recv(theirs, src, group=self.group, tag=TAG_PARAMS)
                with self.lock:
                    flat = self._flat()
                    avg = theirs.add_(self._current(flat)).div_(2)
                    self.pending = (avg, flat)
                    steps = self.steps
                    self.served += 1
                dist.send(torch.tensor([steps]), src, group=self.group, tag=TAG_REPLY_HEADER)
                dist.send(avg, src, group=self.group, tag=TAG_REPLY)
        except BaseException as e:  # raised in the owner's thread at its next step or at close
            self.error = e

    def check(self) -> None:
        """Raise in the owner's thread what the server thread raised."""
        if self.error is not None:
            raise RuntimeError(f"AD-PSGD server thread on rank {dist.get_rank()} failed: {self.error}") from self.error

    def close(self) -> None:
        """Active: say goodbye to each neighbour (and wait for its answer). Passive: wait until every active
        neighbour has said goodbye, then apply what is pending."""
        if self.active:
            for peer in self.neighbours:
                dist.send(torch.tensor([BYE, self.steps]), peer, group=self.group, tag=TAG_HEADER)
                dist.recv(torch.empty(1, dtype=torch.int64), peer, group=self.group, tag=TAG_REPLY_HEADER)
        elif self._thread is not None:
            self._thread.join(self.timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"AD-PSGD: rank {dist.get_rank()} waited {self.timeout_s:g} s for its active "
                                   f"neighbours {self.neighbours} to finish (launch.timeout_s)")
            self.check()
            sys.setswitchinterval(self._switch_interval)
        with self.lock:
            self.apply_pending()


class AsyncGossipStrategy(GossipStrategy):
    """Local steps; after each (every `every`), an active rank averages with one random passive neighbour."""

    name = "gossip_async"

    def __init__(self, model, module, optimizer, loss_fn, precision, local_batch, group, every: int, topology: str,
                 seed: int, timeout_s: float):
        super().__init__(model, module, optimizer, loss_fn, precision, local_batch, group, every, topology)
        # A process group of its own: the server thread's receives never meet the trainer's collectives.
        self.link = dist.new_group(group_ranks(group), backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.averager = PairAverager(list(module.parameters()), self.link, topology, seed, timeout_s)
        self._window = [0, 0, 0]  # exchanges this rank made since the last record: count, staleness sum, max
        self._closed = False
        self.averager.start()

    def forward_backward(self, micro_batches):
        self.averager.check()
        with self.averager.lock:
            self.averager.apply_pending()
        return super().forward_backward(micro_batches)

    def optimizer_step(self) -> None:
        a = self.averager
        with a.lock:
            Strategy.optimizer_step(self)  # the local step only: no synchronous round
            self.steps += 1
            a.steps = self.steps
            a.apply_pending()
        if a.active and self.steps % self.every == 0:
            stale = a.exchange(self.steps)
            w = self._window
            w[0], w[1], w[2] = w[0] + 1, w[1] + stale, max(w[2], stale)
        self._stale = True
        self._last_step_end = time.perf_counter()

    def step_metrics(self, record: dict) -> dict:
        # Logging steps follow an all-gather: every exchange of this step is complete, none has begun since.
        params = list(self.module.parameters())
        with self.averager.lock:
            self.averager.apply_pending()
            flat = _flatten_dense_tensors([p.detach() for p in params])  # on the device: the dp group may be NCCL's
        out: dict[str, Any] = {"consensus_distance": consensus_distance([flat], self.group)}
        window = torch.tensor(self._window, dtype=torch.float64, device=flat.device)
        dist.all_reduce(window[:2], group=self.group)
        dist.all_reduce(window[2:], op=dist.ReduceOp.MAX, group=self.group)
        self._window = [0, 0, 0]
        count, total, worst = window.tolist()
        out.update({"exchanges": int(count), "staleness_mean": total / count if count else None,
                    "staleness_max": int(worst) if count else None})
        return out

    def _local_state(self) -> dict[str, torch.Tensor]:
        dist.barrier(group=self.group)  # every active rank is between exchanges: the pair sums are whole
        with self.averager.lock:
            self.averager.apply_pending()
            return super()._local_state()

    def finish(self) -> None:
        if not self._closed:
            self._closed = True
            self.averager.close()
            dist.destroy_process_group(self.link)

    def report(self) -> dict:
        out = super().report()
        a = self.averager
        out.update({"role": "active" if a.active else "passive", "exchanges": a.exchanges, "served": a.served,
                    "staleness": a.staleness})
        return out

    def figures(self, reports: list[dict], run_dir) -> dict:
        out = super().figures(reports, run_dir)
        staleness = [s for r in reports for s in r["staleness"]]
        hist: dict[str, int] = {}
        for s in staleness:
            hist[str(s)] = hist.get(str(s), 0) + 1
        out["gossip"].update({
            "roles": [r["role"] for r in reports], "exchanges_per_rank": [r["exchanges"] for r in reports],
            "served_per_rank": [r["served"] for r in reports],
            "staleness_mean": sum(staleness) / len(staleness) if staleness else None,
            "staleness_max": max(staleness) if staleness else None,
            "staleness_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0])))})
        return out


def build(b: Build) -> Strategy:
    keys = b.keys(GossipKeys)
    return AsyncGossipStrategy(b.parallelize(b.module), b.module, b.make_optimizer(b.module), b.loss_fn, b.precision,
                               b.local_batch, b.rt.axis_group("dp"), keys.gossip_every, keys.gossip_topology,
                               b.cfg.train.seed, b.cfg.launch.timeout_s)
