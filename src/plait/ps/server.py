"""One parameter server: a shard of the parameters, its optimizer, and the rules of `parallel.ps_mode`.

Workers call `call` below by RPC (`rpc.rpc_sync("ps0", call, args=("push_sync", ...))`); it acts on
this process's ParameterServer. With parallel.ps_placement = 'colocated' every worker process runs
one (server k in worker k), and a worker calls its own directly, without RPC.

Modes (Li et al. 2014; Ho et al. 2013):

* sync: a round ends when every worker has pushed its gradient; the server averages them (as DDP's
  all-reduce does: each divided by dp, then summed), returns the per-parameter norms so that the
  workers clip by the global norm exactly as the all-reduce layout does, then applies one optimizer
  step when the first worker sends the clip coefficient and learning rate. Same parameters as
  dp all-reduce, up to the order of additions.
* async: every push is one optimizer step on arrival, with the pushing worker's learning rate; its
  staleness is the number of updates applied since the parameters it was computed from.
* ssp: async, but a push returns only once the worker is at most `staleness` updates ahead of the
  slowest live worker (plait.ps.policy).

The server pings workers that have not said they are done; one that cannot be reached is dead. In
async and ssp the others go on without it; in sync mode the round cannot complete and the waiting
workers get an error naming it. The server ends when every worker is done or dead.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch
import torch.distributed.rpc as rpc

from plait.ps.policy import Piece, StalenessPolicy, piece_key, staleness_summary
from plait.ps.rpc import worker_name
from plait.report.plots import plt, save


class PSError(RuntimeError):
    """A synchronous round that cannot complete (a worker died)."""


class ParameterServer:
    def __init__(self, index: int, module: torch.nn.Module, pieces: list[Piece], cfg, make_optimizer,
                 host: int | None = None):
        """pieces: this server's whole tensors or row blocks of `module`'s parameters (plait.ps.policy); make_optimizer(
        module, only=None): the job's optimizer over a module's parameters.

        host: the worker this server runs in (parallel.ps_placement = 'colocated'), which it does not ping.
        """
        named = dict(module.named_parameters())
        self.index, self.host = index, host
        # A whole tensor is the module's own parameter; a row block, a parameter of its own (a copy of the rows).
        self.params = {piece_key(pc): named[pc[0]] if pc[1] is None else
                       torch.nn.Parameter(named[pc[0]].detach()[pc[1]:pc[2]].clone(), named[pc[0]].requires_grad)
                       for pc in pieces}
        self.names = list(self.params)
        holder = torch.nn.Module()
        holder.pieces = torch.nn.ParameterList(self.params.values())
        self.optimizer = make_optimizer(holder) if pieces else None
        p = cfg.parallel
        self.dp, self.mode, self.timeout_s = p.dp, p.ps_mode, cfg.launch.timeout_s
        self.policy = StalenessPolicy(p.ps_mode, p.staleness)
        self.cv = threading.Condition()
        self.version = 0  # optimizer steps applied
        self.opened = False
        self.done: set[int] = set()
        self.dead: set[int] = set()
        self.clocks = [0] * self.dp
        self.pending: dict[int, dict[int, tuple[dict, float]]] = {}  # sync: round -> worker -> (grads, loss)
        self.results: dict[int, tuple[list[torch.Tensor], float]] = {}
        self.applied = -1
        self.log: list[tuple[int, int, int]] = []  # (worker, clock, staleness) of every update applied
        self.failure: str | None = None

    # ---- helpers (called with self.cv held)
    def _live(self) -> list[int]:
        return [w for w in range(self.dp) if w not in self.done and w not in self.dead]

    def _wait(self, ready) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            if self.failure:
                raise PSError(self.failure)
            if not self.cv.wait(timeout=max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                raise PSError(f"ps{self.index}: waited {self.timeout_s} s (launch.timeout_s) for the other workers")

    def _step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    def _copy(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}

    # ---- requests
    def push_sync(self, worker: int, rnd: int, grads: dict[str, torch.Tensor], loss: float):
        with self.cv:
            self._wait(lambda: self.opened)
            self.pending.setdefault(rnd, {})[worker] = (grads, loss)
            if len(self.pending[rnd]) == self.dp:
                got = [self.pending[rnd][w] for w in range(self.dp)]
                for n, p in self.params.items():
                    total = got[0][0][n] / self.dp
                    for g, _ in got[1:]:
                        total = total + g[n] / self.dp
                    p.grad = total
                grads_list = [p.grad for p in self.params.values()]
                norms = [t.clone() for t in torch._foreach_norm(grads_list)] if grads_list else []
                self.results[rnd] = (norms, sum(loss for _, loss in got) / self.dp)
                self.results.pop(rnd - 2, None)
                self.pending.pop(rnd)
                self.cv.notify_all()
            self._wait(lambda: rnd in self.results)
            return self.results[rnd]

    def apply_sync(self, worker: int, rnd: int, coef: float | None, lr: float):
        with self.cv:
            if self.applied < rnd:
                if self.params:
                    if coef is not None:
                        torch._foreach_mul_([p.grad for p in self.params.values()], torch.tensor(coef))
                    self._step(lr)
                self.applied = rnd
                self.log.extend((w, rnd, 0) for w in range(self.dp))
            return self._copy()

    def push_async(self, worker: int, version: int, grads: dict[str, torch.Tensor], lr: float):
        with self.cv:
            self._wait(lambda: self.opened)
            staleness = self.version - version
            if self.params:
                for n, p in self.params.items():
                    p.grad = grads[n]
                self._step(lr)
            self.log.append((worker, self.clocks[worker], staleness))
            self.clocks[worker] += 1
            self.cv.notify_all()
            self._wait(lambda: self.policy.may_proceed(self.clocks[worker], [self.clocks[w] for w in self._live()]))
            return self.version, self._copy(), staleness

    def pull(self):
        with self.cv:
            return self.version, self._copy()

    def state(self) -> dict:
        """Parameters and optimizer state of the shard by parameter name (the optimizer's state made if still empty)."""
        with self.cv:
            if self.optimizer is not None and not self.optimizer.state:
                for p in self.params.values():
                    p.grad = torch.zeros_like(p)
                lrs = [g["lr"] for g in self.optimizer.param_groups]
                self._step(0.0)  # lr 0: creates the state, moves nothing
                self.version -= 1
                for g, lr in zip(self.optimizer.param_groups, lrs):
                    g["lr"] = lr
            optim = {n: {k: v.clone() if torch.is_tensor(v) else v for k, v in self.optimizer.state[p].items()}
                     for n, p in self.params.items()} if self.optimizer is not None else {}
            return {"params": self._copy(), "optim": optim}

    def load(self, state: dict) -> None:
        with self.cv:
            for n, p in self.params.items():
                p.data.copy_(state["params"][n])
                if n in state["optim"]:
                    self.optimizer.state[p] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state["optim"][n].items()}

    def open(self) -> None:
        with self.cv:
            self.opened = True
            self.cv.notify_all()

    def wait_open(self, worker: int | None = None) -> int:
        """Wait until the chief opens the server; `worker` (re)joins: a worker counted dead or done is live again.

        A worker that joins mid-run (a replacement, a late start) takes the slowest live worker's clock, so that
        under SSP it neither holds the others back nor waits for them; its first pull gives it the current
        parameters.
        """
        with self.cv:
            self._wait(lambda: self.opened)
            if worker is not None:
                self.dead.discard(worker)
                self.done.discard(worker)
                others = [self.clocks[w] for w in self._live() if w != worker]
                self.clocks[worker] = max(self.clocks[worker], min(others, default=0))
                self.cv.notify_all()
            return self.version

    def finish(self, worker: int) -> list[int]:
        """Worker `worker` pushes no more; returns the workers found dead so far (then the job cannot end in order)."""
        with self.cv:
            self.done.add(worker)
            self.cv.notify_all()
            return sorted(self.dead)

    def settle(self) -> list[int]:
        """Wait until every worker is done or found dead; returns the dead (then the job cannot end in order: an
        orderly leave would wait for them until its timeout)."""
        with self.cv:
            while self._live():
                self.cv.wait(timeout=1.0)
            return sorted(self.dead)

    def staleness(self, since: int) -> tuple[list[int], int]:
        with self.cv:
            return [s for _, _, s in self.log[since:]], len(self.log)

    # ---- the server's own loop
    def serve(self, ping_every_s: float = 0.5) -> None:
        """Answer requests until every worker is done or gone; find dead workers by pinging them."""
        while True:
            with self.cv:
                # every ping_every_s, not at every request's notify (that was a ping round per push)
                deadline = time.monotonic() + ping_every_s
                while self._live() and time.monotonic() < deadline:
                    self.cv.wait(timeout=deadline - time.monotonic())
                waiting = self._live()
                if not waiting:
                    return
            for w in waiting:
                if w == self.host:  # its own worker: alive while this process is
                    continue
                try:
                    rpc.rpc_sync(worker_name(w), ping, timeout=self.timeout_s)
                except Exception as e:  # a dead peer: broken pipe / connection refused at once
                    with self.cv:
                        if w in self.done:
                            continue
                        self.dead.add(w)
                        if self.mode == "sync":
                            self.failure = (f"worker {w} is gone ({str(e).splitlines()[0][:120]}); a synchronous "
                                            "step needs every worker: resume from the last checkpoint, or use "
                                            "parallel.ps_mode = 'async' or 'ssp' to go on without it")
                        self.cv.notify_all()

    def report(self, run_dir: Path | None, plot: bool = True) -> dict:
        """Summary of this server's updates; server 0 writes ps_staleness.json (and staleness.png) to the run dir."""
        values = [s for _, _, s in self.log]
        out = {"server": self.index, "parameters": self.names, "updates": self.version, "dead_workers": sorted(self.dead),
               **staleness_summary(values)}
        if run_dir is not None and self.index == 0:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            (Path(run_dir) / "ps_staleness.json").write_text(json.dumps(
                {"mode": self.mode, "log": [{"worker": w, "clock": c, "staleness": s} for w, c, s in self.log],
                 **{k: v for k, v in out.items() if k != "parameters"}}, indent=1))
            if plot:
                plot_staleness(self.log, Path(run_dir) / "staleness.png", self.mode)
        return out


def plot_staleness(log: list[tuple[int, int, int]], out: Path, mode: str) -> Path | None:
    """Staleness of every update against its order, one colour per worker, and its histogram."""
    if not log:
        return None

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for w in sorted({w for w, _, _ in log}):
        pts = [(i, s) for i, (v, _, s) in enumerate(log) if v == w]
        a.plot(*zip(*pts), ".", ms=3, label=f"worker {w}")
    from matplotlib.ticker import MaxNLocator

    a.yaxis.set_major_locator(MaxNLocator(integer=True))
    a.set_xlabel("update")
    a.set_ylabel("staleness (updates)")
    a.set_title(f"parameter server ({mode}): staleness of each update")
    a.legend(fontsize=8)
    values = [s for _, _, s in log]
    b.hist(values, bins=range(0, max(values) + 2), align="left", rwidth=0.8)
    b.xaxis.set_major_locator(MaxNLocator(integer=True))
    b.set_xlabel("staleness")
    b.set_ylabel("updates")
    save(fig, out)
    return out


# ---- RPC entry points: run on the server process, act on its ParameterServer

_SERVER: ParameterServer | None = None
_READY = threading.Event()


def _server() -> ParameterServer:
    if not _READY.wait(timeout=600):
        raise PSError("the parameter server did not start")
    return _SERVER


def start(server: ParameterServer) -> None:
    global _SERVER
    _SERVER = server
    _READY.set()


def ping() -> bool:
    return True


REQUESTS = frozenset({"push_sync", "apply_sync", "push_async", "pull", "state", "load", "open", "wait_open", "finish",
                      "settle", "staleness"})


def call(method: str, *args):
    """A worker's request: run ParameterServer.`method` (one of REQUESTS) on this process's server."""
    if method not in REQUESTS:
        raise PSError(f"unknown parameter-server request {method!r}")
    return getattr(_server(), method)(*args)
