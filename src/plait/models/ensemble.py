"""Deep ensembles (model.ensemble = K): K members of the configured model, each from its own initial weights, trained
together on the same batches; the ensemble predicts with the members' average probability.

Member k is built right after torch's generator is seeded with s + k, where s is the seed the job's model is built
from (train.init_seed, or train.seed): member 0 is the model a plain run builds, member k the one a run with
train.init_seed = s + k builds. In training the forward returns every member's logits, stacked (K, batch, ...), and
`ensemble_loss` makes one loss whose gradient for each member is that member's own loss's: with the same batches
and an optimizer that treats each parameter on its own (SGD, Adam, AdamW; not a clipped global norm), each member
follows its own run. In evaluation (and serving) the forward returns log(mean_k softmax(logits_k)): the ensemble's
log-probabilities, which the usual loss and argmax take as logits; `spread` gives the members' disagreement.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn


class Ensemble(nn.Module):
    def __init__(self, members: list[nn.Module]):
        super().__init__()
        self.members = nn.ModuleList(members)

    def held(self) -> list[nn.Module]:
        """The members this process holds (all of them, but for a spread ensemble's rank)."""
        return list(self.members.values()) if isinstance(self.members, nn.ModuleDict) else list(self.members)

    def keep(self, member: int) -> None:
        """Hold member `member` alone, under its own name (members.<member>.*): a spread ensemble's rank trains one."""
        self.members = nn.ModuleDict({str(member): self.members[member]})  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.stack([m(x) for m in self.held()])
        if self.training:
            return logits
        return mean_log_prob(torch.log_softmax(logits.float(), -1))

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the eval forward's log-probabilities, the spread) from one pass of the members: what serving answers."""
        log_probs = torch.stack([torch.log_softmax(m(x).float(), -1) for m in self.held()])  # (K, batch, classes)
        return mean_log_prob(log_probs), _spread(log_probs.exp())

    @torch.no_grad()
    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """Per row, the standard deviation over the members of the probability each gives the ensemble's choice."""
        return self.predict(x)[1]


def mean_log_prob(log_probs: torch.Tensor) -> torch.Tensor:
    """log(mean_k p_k) from the members' log-probabilities (K, ...)."""
    return torch.logsumexp(log_probs, 0) - torch.log(torch.tensor(float(len(log_probs))))


def _spread(probs: torch.Tensor) -> torch.Tensor:
    label = probs.mean(0).argmax(-1, keepdim=True)
    return probs.gather(-1, label.expand(len(probs), *label.shape)).squeeze(-1).std(0, unbiased=False)


def build_ensemble(count: int, build: Callable[[], nn.Module]) -> Ensemble:
    """`count` members, member k built after seeding torch's generator with (the seed set last) + k."""
    base = torch.initial_seed()
    members = []
    for k in range(count):
        torch.manual_seed(base + k)
        members.append(build())
    return Ensemble(members)


def ensemble_loss(loss_fn: Callable, model: Ensemble) -> Callable:
    """The training loss of stacked member logits (K, batch, ...): its value is the members' mean loss, its gradient
    each member's own loss's gradient (so each member's update is the one its own run makes). In evaluation (the
    model's eval mode: the ensemble's log-probabilities) loss_fn takes the logits as they are."""

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not model.training:
            return loss_fn(logits, y)
        each = torch.stack([loss_fn(member, y) for member in logits])
        return each.sum() - each.detach().sum() + each.detach().mean()

    return loss
