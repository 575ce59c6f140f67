"""A worker's side of the parameter server: push gradients, pull parameters, shard by shard.

Every call goes to all K servers at once (rpc_async) and waits for all answers. Tensors travel
on CPU; parameters are copied into the worker's model on its own device. The bytes pushed are
counted by plait.comm.accounting (op "ps_push"), so `comm_bytes` in metrics.jsonl is the
gradient volume a worker sends per step.
"""

from __future__ import annotations

import atexit

import torch
import torch.distributed.rpc as rpc

from plait.comm import accounting
from plait.ps import server as srv
from plait.ps.rpc import leave, server_name


class PSClient:
    def __init__(self, module: torch.nn.Module, worker: int, shards: list[list[str]], timeout_s: float = 300.0):
        self.module, self.worker, self.shards, self.timeout_s = module, worker, shards, timeout_s
        self.params = dict(module.named_parameters())
        self.versions = [0] * len(shards)
        self.rounds = 0  # sync: rounds this worker has pushed
        self.finished = False
        self.completed = False  # set when the training loop ended normally: then the job may end in order
        # Tell the servers at exit (before the RPC agent stops: atexit runs last-in, first-out).
        atexit.register(self.finish)

    def _all(self, fn, args_for) -> list:
        futs = [rpc.rpc_async(server_name(k), fn, args=args_for(k)) for k in range(len(self.shards))]
        return [f.wait() for f in futs]

    def _grads(self, k: int) -> dict[str, torch.Tensor]:
        out = {}
        for n in self.shards[k]:
            p = self.params[n]
            out[n] = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu()
        accounting.record("ps_push", sum(t.numel() * t.element_size() for t in out.values()))
        return out

    @torch.no_grad()
    def _load(self, values: dict[str, torch.Tensor]) -> None:
        for n, v in values.items():
            self.params[n].copy_(v)

    # ---- start and end
    def open(self) -> None:
        """Chief: the servers hold the state to start from (fresh, or loaded from a checkpoint); let the workers in."""
        self._all(srv.open_server, lambda k: ())
        self.pull()

    def wait_open(self) -> None:
        self._all(srv.wait_open, lambda k: ())
        self.pull()

    def finish(self) -> None:
        """This worker will push no more (the servers stop waiting for it), then leaves the RPC job: in order
        after a normal end with every worker alive, else at once. Idempotent, quiet if the servers are gone."""
        if self.finished:
            return
        self.finished = True
        try:
            dead = any(self._all(srv.finish, lambda k: (self.worker,)))
        except RuntimeError:
            dead = True
        leave(self.completed and not dead, self.timeout_s)

    def pull(self) -> None:
        for k, (version, values) in enumerate(self._all(srv.pull, lambda k: ())):
            self.versions[k] = version
            self._load(values)

    # ---- sync rounds
    def push_sync(self, loss: float) -> tuple[list[torch.Tensor], float]:
        """Push this round's gradients; returns the averaged gradients' norms in model order and the workers' mean loss."""
        answers = self._all(srv.push_sync, lambda k: (self.worker, self.rounds, self._grads(k), loss))
        norms = {n: t for k, (ns, _) in enumerate(answers) for n, t in zip(self.shards[k], ns)}
        return [norms[n] for n in self.params if n in norms], answers[0][1]

    def apply_sync(self, coef: float | None, lr: float) -> None:
        for values in self._all(srv.apply_sync, lambda k: (self.worker, self.rounds, coef, lr)):
            self._load(values)
        self.rounds += 1

    # ---- async / ssp
    def push_async(self, lr: float) -> list[int]:
        """Push, get the shard's fresh parameters back (after the SSP wait); returns each shard's staleness."""
        answers = self._all(srv.push_async, lambda k: (self.worker, self.versions[k], self._grads(k), lr))
        out = []
        for k, (version, values, staleness) in enumerate(answers):
            self.versions[k] = version
            self._load(values)
            out.append(staleness)
        return out

    # ---- checkpoints
    def state(self) -> tuple[dict, dict]:
        """(parameters, optimizer state), each keyed by parameter name, from all servers."""
        params, optim = {}, {}
        for answer in self._all(srv.get_state, lambda k: ()):
            params.update(answer["params"])
            optim.update(answer["optim"])
        return params, optim

    def load(self, params: dict, optim: dict) -> None:
        def part(k):
            names = self.shards[k]
            return ({"params": {n: params[n].detach().cpu() for n in names},
                     "optim": {n: {s: v.detach().cpu() if torch.is_tensor(v) else v for s, v in optim[n].items()}
                               for n in names if n in optim}},)

        self._all(srv.load_state, part)
        self._load({n: params[n] for n in self.params})

    def staleness_since(self, since: int) -> tuple[list[int], int]:
        return rpc.rpc_sync(server_name(0), srv.staleness_since, args=(since,))
