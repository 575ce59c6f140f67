"""Data parallel through a parameter server (`parallel.sync = 'ps'`): the worker's Strategy.

Each worker computes the gradient of its slice of the global batch, pushes it to the servers
(plait.ps) and takes their parameters back; the optimizer lives on the servers. Rank 0, the chief
worker, runs plait's trainer loop (metrics, evaluation, checkpoints of the servers' state); the
trainer gives it the whole global batch, of which it takes its own slice. The other workers run
plait.ps.worker's loop on their slices.

* sync: push -> the servers average and return the norms -> clip by the global norm -> apply:
  dp all-reduce's parameters, step for step.
* async / ssp: clip the worker's own gradient, push; the servers apply it at once and send the
  parameters back (after the bounded-staleness wait under ssp).
"""

from __future__ import annotations

import torch

from plait.parallel.base import Strategy
from plait.ps.client import PSClient
from plait.ps.policy import staleness_summary


class PSStrategy(Strategy):
    def __init__(self, module, optimizer, loss_fn, precision, local_batch: int, client: PSClient, mode: str,
                 worker: int, dp: int, servers: int, whole_batches: bool):
        super().__init__(module, module, optimizer, loss_fn, precision, local_batch)
        self.client, self.mode, self.chief = client, mode, worker == 0
        self.slice_of = (worker, dp) if whole_batches else None  # take this worker's share of each whole global batch
        self.name = f"ps-{mode}: {dp} workers + {servers} server{'s' * (servers > 1)}"
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
        if self.slice_of is not None:
            worker, dp = self.slice_of
            share = len(micro_batches) // dp
            micro_batches = micro_batches[worker * share:(worker + 1) * share]
        self._loss = super().forward_backward(micro_batches)
        return self._loss

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor | None:
        if self.mode != "sync":
            return super().clip_grad_norm(max_norm)
        norms, mean_loss = self.client.push_sync(float(self._loss))
        # The trainer adds this tensor to its loss window after the step: make it the workers' mean.
        self._loss.fill_(mean_loss)
        if max_norm <= 0:
            self._coef = None
            return None
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
        params = {n: state["model"][n] for n, _ in self.module.named_parameters()}
        self.client.load(params, state["optim"]["state"])
        self.module.load_state_dict(state["model"])

    def full_model_state_dict(self) -> dict:
        if self._opened:
            self.client.pull()
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}


def build_ps_strategy(module, cfg, rt, make_optimizer, loss_fn, precision, whole_batches: bool) -> PSStrategy:
    """The worker's strategy: shards assigned as every rank assigns them, a local optimizer only for the learning rate.

    whole_batches: the data loader gives the whole global batch (the chief under the trainer), not this worker's slice.
    """
    from plait.ps.policy import assign_shards

    p = cfg.parallel
    shards = assign_shards({n: q.numel() * q.element_size() for n, q in module.named_parameters()}, p.ps_servers)
    client = PSClient(module, rt.rank, shards)
    return PSStrategy(module, make_optimizer(module), loss_fn, precision, cfg.train.global_batch_size // p.dp, client,
                      p.ps_mode, rt.rank, p.dp, p.ps_servers, whole_batches)
