"""A deep ensemble spread over the dp ranks (model.ensemble = K with dp a multiple of K, plain DDP replicas).

The dp axis is cut into K groups of dp / K consecutive ranks (plait.parallel.layout: the "member" and "batch"
axes); group k holds member k alone (members.<k>.* , the names of the whole ensemble) and trains it as its own run
would: each group reads the whole global batch, split over its dp / K ranks, and averages its gradients among
them by DDP (plait.runtime.Runtime.replica_mesh), never with another member's. What the job reports is the
ensemble's: the loss is the members' mean (the dp axis's average), the gradient norm is over every member's
gradients (their squares summed over the members), evaluation gathers each validation batch's log-probabilities
from one rank of each member and averages the probabilities, and checkpoints and exports hold every member.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from plait.models.ensemble import Ensemble, mean_log_prob
from plait.parallel import ddp
from plait.parallel.base import correct_predictions
from plait.parallel.embedding import gather_over_dp
from plait.parallel.gradsync import clip_grad_norm
from plait.parallel.scheme import Build


class SpreadEnsembleStrategy(ddp.DDPStrategy):
    eval_axis = "batch"  # each validation batch is evaluated by one rank of every member together

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.name = "ddp, ensemble members spread"
        self.members = 1  # set by build: the members, one group of ranks each
        self.member_group = None  # set by build: one rank of each member (this one's batch slice)

    def clip_grad_norm(self, max_norm: float, need_norm: bool = True):
        """The norm of every member's gradient: this member's squares summed with one rank of each other member's."""
        self.precision.unscale(self.optimizer, self.overflow_group())
        if max_norm <= 0 and not need_norm:
            return None
        return clip_grad_norm([], max_norm, partial=self.module.parameters(), group=self.member_group)

    @torch.no_grad()
    def eval_batch(self, x: torch.Tensor, y: torch.Tensor):
        """The ensemble's loss and right answers on one batch: every member's log-probabilities, averaged."""
        with self.precision.autocast():
            mine = self.model(x).float()  # this member's log-probabilities (the eval forward of one member)
        every = [torch.empty_like(mine) for _ in range(self.members)]
        dist.all_gather(every, mine.contiguous(), group=self.member_group)
        log_probs = mean_log_prob(torch.stack(every))
        return self.loss_fn(log_probs, y).double(), correct_predictions(log_probs, y)

    def full_model_state_dict(self) -> dict:
        return gather_over_dp(super().full_model_state_dict(), self.member_group, self.members)


def keep_member(model: nn.Module, b: Build) -> nn.Module:
    if not isinstance(model, Ensemble):
        raise TypeError(f"a spread ensemble's model is an Ensemble, not {type(model).__name__}")
    model.keep(b.rt.axis_rank("member"))
    return model


def build(b: Build) -> SpreadEnsembleStrategy:
    strategy = ddp.build(b, SpreadEnsembleStrategy)
    assert isinstance(strategy, SpreadEnsembleStrategy)
    strategy.members = b.layout.members
    strategy.member_group = b.rt.ensemble_mesh["member"].get_group()
    return strategy
