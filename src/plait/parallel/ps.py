"""Data parallel through a parameter server (`parallel.sync = 'ps'`): the workers' Strategy and the servers' role.

Every worker runs plait's training loop on its own slice of each global batch, pushes its
gradient to the servers (plait.ps) and takes their parameters back; the optimizer lives on the
servers. Worker 0, the chief, also writes the run's files (metrics, evaluation, checkpoints of
the servers' state); the other workers write nothing, so one can die without touching the run
directory. Server ranks do not train: they hold their shard until every worker is done or gone.

* sync: push -> the servers average and return the norms -> clip by the global norm -> apply:
  dp all-reduce's parameters, step for step.
* async / ssp: clip the worker's own gradient, push; the servers apply it at once and send the
  parameters back (after the bounded-staleness wait under ssp).

parallel.ps_placement = 'colocated' (BytePS / MXNet's kvstore): no server processes; worker k also
serves shard k of dp (balanced by bytes) from a thread of its own, so the job is dp processes and a
worker's own shard never crosses the network. Every worker is then needed to the end (it holds
state): a dead worker stops the job, in every mode.
"""

from __future__ import annotations

import copy
import threading
import time

import torch

from plait.parallel.base import Strategy
from plait.parallel.keys import ParameterServerKeys
from plait.parallel.scheme import Build
from plait.ps import server as srv
from plait.ps.client import PSClient
from plait.ps.policy import Piece, assign_shards, split_rows, staleness_summary, whole
from plait.ps.rpc import leave, worker_name


class PSStrategy(Strategy):
    def __init__(self, model, module, optimizer, loss_fn, precision, local_batch: int, client: PSClient, mode: str,
                 worker: int, dp: int, servers: int, colocated: bool = False):
        super().__init__(model, module, optimizer, loss_fn, precision, local_batch)
        self.client, self.mode, self.chief = client, mode, worker == 0
        self.name = (f"ps-{mode}: {dp} workers serving 1/{dp} each (colocated)" if colocated else
                     f"ps-{mode}: {dp} workers + {servers} server{'s' * (servers > 1)}")
        self._opened = False
        self._coef: torch.Tensor | None = None
        self._loss: torch.Tensor | None = None
        self._staleness: list[int] = []
        self._log_cursor = 0

    def _open(self) -> None:
        if not self._opened:
            # The chief lets the others in once the servers hold the state to start from (after a resume).
            self.client.open() if self.chief else self.client.wait_open()
            self._opened = True

    def forward_backward(self, micro_batches):
        self._open()
        self._loss = super().forward_backward(micro_batches)
        return self._loss

    def clip_grad_norm(self, max_norm: float, need_norm: bool = True) -> torch.Tensor | None:
        if self.mode != "sync":
            return super().clip_grad_norm(max_norm, need_norm)
        loss = self._loss
        assert loss is not None, "forward_backward ran before the clip"
        norms, mean_loss = self.client.push_sync(float(loss))
        # The trainer adds this tensor to its loss window after the step: make it the workers' mean.
        loss.fill_(mean_loss)
        if max_norm <= 0:
            self._coef = None
            return torch.linalg.vector_norm(torch.stack(norms)) if need_norm else None
        total = torch.linalg.vector_norm(torch.stack(norms))  # as clip_grad_norm_ combines per-tensor norms
        self._coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return total

    def optimizer_step(self) -> None:
        lr = self.optimizer.param_groups[0]["lr"]
        if self.mode == "sync":
            self.client.apply_sync(None if self._coef is None else float(self._coef), lr)
        else:
            self._staleness.extend(self.client.push_async(lr))
        self.optimizer.zero_grad(set_to_none=True)

    def finish(self) -> None:
        self.client.completed = True  # the loop ended normally: leave the RPC job in order (every rank meets)
        if not self.chief:  # the chief's weights are still read after the loop (export, sample); it finishes at exit
            self.client.finish()

    def step_metrics(self, record: dict) -> dict:
        """Staleness of every update the servers applied since the last record (server 0's count)."""
        values, self._log_cursor = self.client.staleness_since(self._log_cursor)
        return staleness_summary(values)

    # ---- checkpoints: the servers' state, under the plain model's names
    def state_dict(self) -> dict:
        params, optim = self.client.state()
        model = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        model.update(params)
        return {"model": model, "optim": {"state": optim}}

    def load_state_dict(self, state: dict) -> None:
        if not self.chief:  # the chief loads the servers; the others pull from them when they open
            return
        params = {n: state["model"][n] for n, _ in self.module.named_parameters()}
        self.client.load(params, state["optim"]["state"])
        self.module.load_state_dict(state["model"])

    def full_model_state_dict(self) -> dict:
        if self._opened:
            self.client.pull()
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}


def shards(module, servers: int, rows: bool = False) -> list[list[Piece]]:
    """Each server's pieces, as every rank computes them: whole tensors balanced by bytes, or (rows: colocated
    servers) row block k of every tensor on server k."""
    named = list(module.named_parameters())
    if rows:
        return split_rows({n: q.shape[0] if q.dim() else 0 for n, q in named}, servers)
    return whole(assign_shards({n: q.numel() * q.element_size() for n, q in named}, servers))


def build(b: Build) -> PSStrategy:
    """A worker's strategy: a local optimizer only for the learning rate; the servers hold the real one."""
    p = b.keys(ParameterServerKeys)
    colocated = p.ps_placement == "colocated"
    client = (colocated_client(b) if colocated else
              PSClient(b.module, b.rt.rank, shards(b.module, p.ps_servers), b.cfg.launch.timeout_s))
    strategy = PSStrategy(b.parallelize(b.module), b.module, b.make_optimizer(b.module), b.loss_fn, b.precision,
                          b.local_batch, client, p.ps_mode, b.rt.rank, b.layout.dp, p.ps_servers, colocated)
    strategy.evaluates = b.layout.role(b.rt.rank) == "trainer"  # the chief; the other workers evaluate nothing
    return strategy


def colocated_client(b: Build) -> PSClient:
    """Worker k's client, with server k (shard k of dp) running in this process: it answers the other workers from
    a thread while this one trains, and the worker leaves only once every worker is done with its shard."""
    dp, rank = b.layout.dp, b.rt.rank
    cut = shards(b.module, dp, rows=True)
    # The server's own copy of the (identically initialised) model, on CPU like a dedicated server's.
    server = srv.ParameterServer(rank, copy.deepcopy(b.module).cpu(), cut[rank], b.cfg, b.make_optimizer, host=rank)
    srv.start(server)
    loop = threading.Thread(target=server.serve, name=f"ps-shard{rank}", daemon=True)
    loop.start()

    def before_leave() -> bool:
        loop.join()  # until every worker is done with this shard (or found dead)
        return bool(server.dead or server.failure)

    return PSClient(b.module, rank, cut, b.cfg.launch.timeout_s, servers=[worker_name(k) for k in range(dp)],
                    local={rank: server}, before_leave=before_leave)


def serve(b: Build, run_dir) -> dict:
    """A server rank: hold this server's shard until every worker is done or gone; returns its summary."""
    cfg = b.cfg
    module = b.module.cpu()
    index = b.rt.rank - b.layout.dp
    server = srv.ParameterServer(index, module, shards(module, b.layout.ps_servers)[index], cfg, b.make_optimizer)
    srv.start(server)
    t0 = time.perf_counter()
    server.serve()
    time.sleep(0.2)  # let the last answers leave before the agent stops
    summary = {"role": "server", **server.report(run_dir, plot=cfg.log.report), "wall_time_s": time.perf_counter() - t0}
    if server.dead:
        print(f"ps{index}: worker(s) {sorted(server.dead)} stopped early; the others finished "
              f"({server.version} updates applied)", flush=True)
    # Every worker said it is done: meet them all and close together (no end-of-file warnings); not with dead ones.
    leave(not server.dead and not server.failure, cfg.launch.timeout_s)
    return summary
