"""Decentralized data parallelism by gossip: no all-reduce and no central node (`parallel.sync = 'gossip'`).

Decentralized parallel SGD (Lian et al. 2017, "Can Decentralized Algorithms Outperform Centralized
Algorithms?"): each rank takes optimizer steps on its own slice of the global batch with its own
gradient, and every `parallel.gossip_every` steps replaces its parameters by the average of its
own and its graph neighbours' (x_i <- sum_j W_ij x_j). The graphs are circulant, so the uniform
weights W_ij = 1 / (neighbours + 1) are doubly stochastic and the average over ranks is kept:

* ring: neighbours i - 1 and i + 1; the spread shrinks by |lambda_2| = (1 + 2 cos(2 pi / n)) / 3
  per round (1/3 on 4 ranks);
* exponential: neighbours i +- 2^k (Assran et al. 2019, SGP; Ying et al. 2021 "Exponential graph is
  provably efficient for decentralized deep training"): log2 n neighbours, a faster mix.

The parameters drift apart between rounds; `consensus_distance` in metrics.jsonl is their spread,
sqrt(1/n sum_i |x_i - x_bar|^2). Evaluation, exports and checkpoints use the average model x_bar
(the iterate the analysis is about). Each rank's optimizer state stays its own while it trains;
a checkpoint holds the ranks' average of it too (saving each rank's would let DCP keep one rank's
copy of each tensor, Adam's first moment from one rank and its second from another), so a resumed
run starts every rank from x_bar and the averaged state: not the exact trajectory.

`parallel.gossip_async = true` makes it asynchronous (AD-PSGD, Lian et al. 2018): plait.parallel.gossip_async.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from plait.comm.algorithms import _exchange, group_ranks
from plait.parallel.base import Strategy
from plait.parallel.keys import GossipKeys
from plait.parallel.scheme import Build


def neighbour_offsets(n: int, topology: str) -> list[int]:
    """Distinct non-zero offsets d (mod n) such that rank i averages with ranks i + d."""
    if topology == "ring":
        base = [1]
    elif topology == "exponential":
        base = [1 << k for k in range(max(1, (n - 1).bit_length())) if (1 << k) < n]
    else:
        raise ValueError(f"unknown gossip topology {topology!r}; choose ring or exponential")
    offsets = {d % n for b in base for d in (b, -b)} - {0}
    return sorted(offsets)


def gossip_average(tensors: list[torch.Tensor], group, offsets: list[int]) -> None:
    """x_i <- (x_i + sum over offsets d of x_{i-d}) / (len(offsets) + 1), in place, on every rank of group."""
    if not offsets:
        return
    ranks = group_ranks(group)
    n, i = len(ranks), ranks.index(dist.get_rank())
    flat = _flatten_dense_tensors([t.detach() for t in tensors])
    acc, buf = flat.clone(), torch.empty_like(flat)
    for d in offsets:
        _exchange(flat, ranks[(i + d) % n], buf, ranks[(i - d) % n])
        acc.add_(buf)
    acc.div_(len(offsets) + 1)
    for t, new in zip(tensors, _unflatten_dense_tensors(acc, tensors)):
        t.detach().copy_(new)


def consensus_distance(tensors: list[torch.Tensor], group) -> float:
    """sqrt(1/n sum_i |x_i - x_bar|^2) over the ranks of group (a collective)."""
    n = dist.get_world_size(group)
    flat = _flatten_dense_tensors([t.detach().double() for t in tensors])
    mean = flat.clone()
    dist.all_reduce(mean, group=group)
    mean /= n
    sq = (flat - mean).pow(2).sum().reshape(1)
    dist.all_reduce(sq, group=group)
    return float((sq / n).sqrt())


class GossipStrategy(Strategy):
    """Local steps on each rank's slice of the batch; neighbour averaging every `every` steps."""

    name = "gossip"

    def __init__(self, model, module, optimizer, loss_fn, precision, local_batch, group, every: int, topology: str):
        super().__init__(model, module, optimizer, loss_fn, precision, local_batch)
        self.group, self.every = group, every
        self.offsets = neighbour_offsets(dist.get_world_size(group), topology)
        self.steps = 0
        self._consensus_model: nn.Module | None = None  # x_bar, for evaluation
        self._stale = True
        # This rank's own pace, for report(): from the start of its second step (the first is a logging step, whose
        # all-gather lines the ranks up) to the end of its last.
        self._calls = 0
        self._paced_from: float | None = None
        self._last_step_end: float | None = None

    def forward_backward(self, micro_batches):
        self._calls += 1
        if self._calls == 2:
            self._paced_from = time.perf_counter()
        return super().forward_backward(micro_batches)

    def optimizer_step(self) -> None:
        super().optimizer_step()
        self.steps += 1
        if self.steps % self.every == 0:
            gossip_average(list(self.module.parameters()), self.group, self.offsets)
        self._stale = True
        self._last_step_end = time.perf_counter()

    def step_metrics(self, record: dict) -> dict:
        return {"consensus_distance": consensus_distance(list(self.module.parameters()), self.group)}

    def report(self) -> dict:
        """This rank's steps and its own pace: steps per second from its second step's start to its last one's end."""
        paced = self._paced_from is not None and self._last_step_end > self._paced_from
        return {"steps": self.steps,
                "steps_per_s": (self._calls - 1) / (self._last_step_end - self._paced_from) if paced else None}

    def figures(self, reports: list[dict], run_dir) -> dict:
        return {"gossip": {"local_steps_per_rank": [r["steps"] for r in reports],
                           "steps_per_s_per_rank": [r["steps_per_s"] for r in reports]}}

    def _local_state(self) -> dict[str, torch.Tensor]:
        """A copy of this rank's plain model state."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def average_state(self) -> dict[str, torch.Tensor]:
        """The plain model's state with every floating-point tensor averaged over the ranks (a collective)."""
        sd = self._local_state()
        floats = [v for v in sd.values() if v.is_floating_point()]
        flat = _flatten_dense_tensors(floats)
        dist.all_reduce(flat, group=self.group)
        flat /= dist.get_world_size(self.group)
        for v, new in zip(floats, _unflatten_dense_tensors(flat, floats)):
            v.copy_(new)
        return sd

    @torch.no_grad()
    def eval_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Every rank evaluates the same number of batches, so the first one after training can average.
        if self._stale:
            if self._consensus_model is None:
                self._consensus_model = copy.deepcopy(self.module)
            self._consensus_model.load_state_dict(self.average_state())
            self._consensus_model.eval()
            self._stale = False
        consensus = self._consensus_model
        assert consensus is not None, "built at the first evaluation"
        live, self.model = self.model, consensus
        try:
            return super().eval_batch(x, y)
        finally:
            self.model = live

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["model"] = self.average_state()
        sd["optim"] = {"state": self._average_optimizer_state(sd["optim"]["state"])}
        return sd

    def _average_optimizer_state(self, state: dict) -> dict:
        """The optimizer state (plain names -> {key: tensor}) with its floating-point tensors averaged over the ranks,
        in new tensors (a collective)."""
        keys = [(name, k) for name in sorted(state) for k in sorted(state[name])
                if torch.is_tensor(state[name][k]) and state[name][k].is_floating_point()]
        out = {name: dict(entries) for name, entries in state.items()}
        if keys:
            tensors = [state[name][k].detach() for name, k in keys]
            flat = _flatten_dense_tensors(tensors)
            dist.all_reduce(flat, group=self.group)
            flat /= dist.get_world_size(self.group)
            for (name, k), new in zip(keys, _unflatten_dense_tensors(flat, tensors)):
                out[name][k] = new
        return out

    def full_model_state_dict(self) -> dict:
        return {k: v.cpu() for k, v in self.average_state().items()}


def build(b: Build) -> Strategy:
    keys = b.keys(GossipKeys)
    return GossipStrategy(b.parallelize(b.module), b.module, b.make_optimizer(b.module), b.loss_fn, b.precision,
                          b.local_batch, b.rt.axis_group("dp"), keys.gossip_every, keys.gossip_topology)
