"""Losses by task; each is a mean over the micro-batch's samples (lm: over its tokens; contrastive: over its views)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F

from plait.callback import Callback
from plait.data.spec import DataSpec
from plait.models.protocols import ExtraLossModel


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def masked_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the targets that are not -100: the mean over each row's trained tokens, then the
    mean over rows (a row with none adds 0). Rows weigh the same however the batch is split: layout-independent."""
    per = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view(targets.shape)
    trained = (targets != -100).sum(1)
    return (per.sum(1) / trained.clamp(min=1)).mean()


class TokenMeanLoss(Callback):
    """train.loss_normalization = "tokens": the chat loss as the mean over every trained token of the global batch (TRL's
    SFTTrainer and torchtune divide the batch's summed cross-entropy by its trained tokens, across accumulation steps
    and ranks). A micro-batch's loss is its rows' mean summed loss over tau, the global batch's trained tokens per row:
    the strategies' scaling by the micro-batch's share of the rows then gives sum / tokens whatever the layout. tau
    depends on the global batch alone, so each step's is computed from the sampler's indices and each sample's count
    (no collective, the same on every rank); outside a training step (evaluation) a batch is its own global batch."""

    def __init__(self, trained: torch.Tensor):
        self.trained = trained.double()  # each training sample's trained tokens
        self.order: Callable[[int], torch.Tensor] | None = None  # step -> the global batch's indices (build_job's)
        self.tau: float | None = None

    def on_step_begin(self, step: int) -> None:
        assert self.order is not None, "build_job gives the loss the sampler's order"
        self.tau = float(self.trained[self.order(step)].mean())

    def on_step_end(self, step: int) -> None:
        self.tau = None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        per = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view(targets.shape)
        if self.tau is None:
            return per.sum() / (targets != -100).sum().clamp(min=1)
        return per.sum(1).mean() / max(self.tau, 1.0)


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets)


def weighted_classification_loss(weights: torch.Tensor) -> Callable:
    """data.class_weights: the mean over the micro-batch's samples of weight[label] * cross-entropy.

    A mean over samples (not PyTorch's division by the sum of the weights), so that micro-batch losses
    scaled by their share of the batch still add up to the global batch's: layout-independent.
    """

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        per = F.cross_entropy(logits.float(), targets, reduction="none")
        return (per * weights.to(per.device)[targets]).mean()

    return loss


def binary_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits.reshape(-1).float(), targets.reshape(-1).float())


def regression_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the micro-batch's samples (and each sample's outputs)."""
    return F.mse_loss(outputs.float().reshape(targets.shape), targets.float())


def nt_xent(z: torch.Tensor, temperature: float, group=None) -> torch.Tensor:
    """NT-Xent (SimCLR, Chen et al. 2020) of this rank's views against every view of the global batch.

    z: (batch, 2, d), the two views' projections of this rank's samples. With a process group (and
    gradients on), the embeddings of every rank are all-gathered with autograd, so the negatives are
    the whole global batch and each rank's loss is the mean over its own 2 * batch anchors: the mean
    of the ranks' losses is the one-process loss, and DDP's average of their gradients its gradient
    (the all-gather's backward sums what every rank's loss sends back). Without a group (one process,
    or evaluation, which never communicates) the batch is its own world. This rank's slice of the
    similarity matrix is (2 * batch) x (2 * global batch) floats.
    """
    b = z.shape[0]
    local = F.normalize(z.float().reshape(2 * b, -1), dim=1)  # rows: sample 0 view 0, sample 0 view 1, ...
    rank, everyone = 0, local
    if group is not None and torch.is_grad_enabled() and dist.get_world_size(group) > 1:
        rank = dist.get_rank(group)
        everyone = torch.cat(dist_nn.all_gather(local, group=group))
    sim = local @ everyone.T / temperature
    mine = torch.arange(2 * b, device=z.device) + rank * 2 * b  # each anchor's own column
    sim = sim.masked_fill(F.one_hot(mine, everyone.shape[0]).bool(), float("-inf"))
    positive = mine ^ 1  # the other view of the same sample
    return F.cross_entropy(sim, positive)


def loss_for(spec: DataSpec, temperature: float = 0.5, group=None) -> Callable:
    """The loss of the data's task; contrastive: NT-Xent at `temperature` against the views of every rank of `group`."""
    if spec.task == "contrastive":
        return lambda z, _labels: nt_xent(z, temperature, group)
    if spec.task == "classification" and spec.class_weights:
        return weighted_classification_loss(torch.tensor(spec.class_weights, dtype=torch.float32))
    if spec.task == "lm" and spec.masked_targets:
        return masked_lm_loss
    return {"lm": lm_loss, "fewshot": lm_loss, "classification": classification_loss, "binary": binary_loss,
            "regression": regression_loss}[spec.task]


def focal_loss(gamma: float) -> Callable:
    """train.loss = "focal" (Lin et al. 2017): -(1 - p_t)^gamma log p_t, the mean over samples (a language model's:
    over tokens), so gamma = 0 is cross-entropy. Soft targets (data.mix) weigh each class's term by its probability."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(logits.float().reshape(-1, logits.shape[-1]), dim=-1)
        if targets.is_floating_point():  # class probabilities
            q = targets.reshape(-1, logits.shape[-1]).float()
            return -(q * (1 - logp.exp()).pow(gamma) * logp).sum(-1).mean()
        logpt = logp.gather(1, targets.reshape(-1, 1)).squeeze(1)
        return -((1 - logpt.exp()).pow(gamma) * logpt).mean()

    return loss


def with_extra_loss(loss_fn: Callable, model) -> Callable:
    """loss_fn plus the model's own training term when it has one: `model.extra_loss()` after each forward.

    A model hook rather than code in a strategy, so that every layout adds the term the same way: an MoE
    model's load-balancing loss (plait.models.moe) is returned by its layers' last training forward, so it
    is part of the micro-batch loss that every strategy scales and averages. Evaluation adds nothing
    (the hook returns None after an evaluation forward).
    """
    if not isinstance(model, ExtraLossModel):
        return loss_fn

    def loss(outputs, targets):
        value, term = loss_fn(outputs, targets), model.extra_loss()
        return value if term is None else value + term

    return loss
