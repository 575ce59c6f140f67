"""A worker's side of the parameter server: push gradients, pull parameters, shard by shard.

Every call goes to all K servers at once (rpc_async) and waits for all answers. Tensors travel
on CPU; parameters are copied into the worker's model on its own device. The bytes pushed are
counted by plait.comm.accounting (op "ps_push"), so `comm_bytes` in metrics.jsonl is the
gradient volume a worker sends per step.

A server in this process (`local`: parallel.ps_placement = 'colocated', or a test) is called
directly, after the requests to the others have left: its shard's gradient never crosses the
network and is not counted, so a colocated worker sends (dp-1)/dp of a dedicated one's bytes.
"""

from __future__ import annotations

import atexit

import torch
import torch.distributed.rpc as rpc

from plait.comm import accounting
from plait.ps import server as srv
from plait.ps.policy import Piece, piece_key
from plait.ps.rpc import leave, server_name


class PSClient:
    def __init__(self, module: torch.nn.Module, worker: int, shards: list[list[Piece]], timeout_s: float = 300.0,
                 servers: list[str] | None = None, local: dict | None = None, before_leave=None):
        """shards: each server's pieces (plait.ps.policy); servers: the RPC name of each shard's server (default ps0,
        ps1, ...); local: {shard: ParameterServer} held in this process; before_leave(): run after this worker
        finished, before it leaves the RPC job."""
        self.module, self.worker, self.shards, self.timeout_s = module, worker, shards, timeout_s
        self.pieces = {piece_key(pc): pc for shard in shards for pc in shard}
        self.servers = servers or [server_name(k) for k in range(len(shards))]
        self.local = local or {}
        self.before_leave = before_leave
        self.params = dict(module.named_parameters())
        self.versions = [0] * len(shards)
        self.rounds = 0  # sync: rounds this worker has pushed
        self.finished = False
        self.completed = False  # set when the training loop ended normally: then the job may end in order
        # Tell the servers at exit (before the RPC agent stops: atexit runs last-in, first-out).
        atexit.register(self.finish)

    def _all(self, method: str, args_for, timeout: float = rpc.constants.UNSET_RPC_TIMEOUT) -> list:
        """ParameterServer.`method`(*args_for(k)) on every server k: the remote ones by RPC, then the local ones
        (timeout: the RPC's in seconds, 0 for none; by default the job's)."""
        remote = {k: rpc.rpc_async(self.servers[k], srv.call, args=(method, *args_for(k)), timeout=timeout)
                  for k in range(len(self.shards)) if k not in self.local}
        here = {k: getattr(server, method)(*args_for(k)) for k, server in self.local.items()}
        out = []
        for k in range(len(self.shards)):
            if k in here:
                out.append(here[k])
                continue
            try:
                out.append(remote[k].wait())
            except RuntimeError as e:
                if self.local and not self.finished:  # colocated: the shard went with its worker
                    raise srv.PSError(
                        f"{self.servers[k]}, which served a shard of the parameters (parallel.ps_placement = "
                        f"'colocated'), is gone ({str(e).splitlines()[0][:120]}); a colocated job needs every worker: "
                        "resume from the last checkpoint, or use parallel.ps_placement = 'dedicated' to go on "
                        "without it") from e
                raise
        return out

    def _grads(self, k: int) -> dict[str, torch.Tensor]:
        out = {}
        for name, lo, hi in self.shards[k]:
            p = self.params[name]
            g = (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
            # a row block is copied: RPC would send a view's whole storage
            out[piece_key((name, lo, hi))] = g.cpu() if lo is None else g[lo:hi].cpu().clone()
        if k not in self.local:  # a shard served in this process crosses no network
            accounting.record("ps_push", sum(t.numel() * t.element_size() for t in out.values()))
        return out

    @torch.no_grad()
    def _load(self, values: dict[str, torch.Tensor]) -> None:
        for key, v in values.items():
            name, lo, hi = self.pieces[key]
            (self.params[name] if lo is None else self.params[name][lo:hi]).copy_(v)

    # ---- start and end
    def open(self) -> None:
        """Chief: the servers hold the state to start from (fresh, or loaded from a checkpoint); let the workers in."""
        self._all("open", lambda k: ())
        self.pull()

    def wait_open(self) -> None:
        """Every worker but the chief, before its first step: join the servers, then take their current parameters
        (a worker that starts late, or replaces a dead one, starts from where the others are, not from its init)."""
        self._all("wait_open", lambda k: (self.worker,))
        self.pull()

    def finish(self) -> None:
        """This worker will push no more (the servers stop waiting for it), then leaves the RPC job: in order
        after a normal end with every worker alive, else at once. Idempotent, quiet if the servers are gone."""
        if self.finished:
            return
        self.finished = True
        try:
            dead = any(self._all("finish", lambda k: (self.worker,)))
            # Then wait until every worker is done or found dead: an orderly leave with a dead peer would wait for it
            # until its timeout (a worker killed after the chief's last step held the job 2 x launch.timeout_s).
            dead = any(self._all("settle", lambda k: (), timeout=0)) or dead
        except RuntimeError:
            dead = True
        if self.before_leave is not None:
            dead = self.before_leave() or dead
        leave(self.completed and not dead, self.timeout_s)

    def pull(self) -> None:
        for k, (version, values) in enumerate(self._all("pull", lambda k: ())):
            self.versions[k] = version
            self._load(values)

    # ---- sync rounds
    def push_sync(self, loss: float) -> tuple[list[torch.Tensor], float]:
        """Push this round's gradients; returns the averaged gradients' norms in model order and the workers' mean loss."""
        answers = self._all("push_sync", lambda k: (self.worker, self.rounds, self._grads(k), loss))
        norms = {pc: t for k, (ns, _) in enumerate(answers) for pc, t in zip(self.shards[k], ns)}
        order = list(self.params)
        return [norms[pc] for pc in sorted(norms, key=lambda pc: (order.index(pc[0]), pc[1] or 0))], answers[0][1]

    def apply_sync(self, coef: float | None, lr: float) -> None:
        for values in self._all("apply_sync", lambda k: (self.worker, self.rounds, coef, lr)):
            self._load(values)
        self.rounds += 1

    # ---- async / ssp
    def push_async(self, lr: float) -> list[int]:
        """Push, get the shard's fresh parameters back (after the SSP wait); returns each shard's staleness."""
        answers = self._all("push_async", lambda k: (self.worker, self.versions[k], self._grads(k), lr))
        out = []
        for k, (version, values, staleness) in enumerate(answers):
            self.versions[k] = version
            self._load(values)
            out.append(staleness)
        return out

    # ---- checkpoints
    def state(self) -> tuple[dict, dict]:
        """(parameters, optimizer state), each keyed by parameter name, from all servers (row blocks joined)."""
        params, optim = {}, {}
        for answer in self._all("state", lambda k: ()):
            params.update(answer["params"])
            optim.update(answer["optim"])
        blocks: dict[str, list[Piece]] = {}
        for pc in sorted(self.pieces.values(), key=lambda pc: pc[1] or 0):
            blocks.setdefault(pc[0], []).append(pc)
        joined, joined_optim = {}, {}
        for name, pcs in blocks.items():
            keys = [piece_key(pc) for pc in pcs]
            joined[name] = params[keys[0]] if pcs[0][1] is None else torch.cat([params[k] for k in keys])
            if keys[0] in optim:
                first = optim[keys[0]]
                # per-element state (moments, momentum) is joined; a step count is the same in every block
                joined_optim[name] = {s: torch.cat([optim[k][s] for k in keys]) if pcs[0][1] is not None and
                                      torch.is_tensor(v) and v.dim() > 0 else v for s, v in first.items()}
        return joined, joined_optim

    def load(self, params: dict, optim: dict) -> None:
        def rows(t, pc):
            return t if pc[1] is None else t[pc[1]:pc[2]].clone()

        def part(k):
            pcs = self.shards[k]
            return ({"params": {piece_key(pc): rows(params[pc[0]].detach().cpu(), pc) for pc in pcs},
                     "optim": {piece_key(pc): {s: rows(v.detach().cpu(), pc) if torch.is_tensor(v) and v.dim() > 0 else v
                                               for s, v in optim[pc[0]].items()}
                               for pc in pcs if pc[0] in optim}},)

        self._all("load", part)
        self._load({piece_key(pc): rows(params[pc[0]], pc) for pc in self.pieces.values()})

    def staleness_since(self, since: int) -> tuple[list[int], int]:
        if 0 in self.local:
            return self.local[0].staleness(since)
        return rpc.rpc_sync(self.servers[0], srv.call, args=("staleness", since))
