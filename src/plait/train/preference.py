"""Preference tuning: train.objective = "dpo", "ipo" or "simpo" on data.name = "preference" pairs (docs/finetune.md).

    loss = preference_loss(cfg, model, bundle, rt)   # fills the reference log-probs (one pass), returns the loss

With c, r the policy's log-probabilities of a pair's chosen and rejected completions (sums over the completion's
tokens, the prompt masked out), c_ref, r_ref the reference model's, |y| a completion's token count, the losses are
TRL's (trl 1.16: DPOTrainer's loss_type "sigmoid" and "ipo", CPOTrainer's "simpo" with cpo_alpha = 0):

    dpo    -log sigma(beta [(c - c_ref) - (r - r_ref)])                      Rafailov et al. 2023
    ipo    ((c - c_ref) / |y_w| - (r - r_ref) / |y_l| - 1 / (2 beta))^2      Azar et al. 2023, per token as TRL has it
    simpo  -log sigma(beta (c / |y_w| - r / |y_l|) - gamma)                  Meng et al. 2024; no reference model

each the mean over the micro-batch's pairs, so micro-batch and data-parallel scaling hold as for any loss. The
implicit rewards are beta (c - c_ref) and beta (r - r_ref) (simpo: beta c / |y_w|, beta r / |y_l|); every metrics
record has their means over the logging window's pairs (reward_chosen, reward_rejected), the margin between them,
the share of pairs whose chosen reward is the higher (reward_accuracy) and the policy's log-probabilities, and each
evaluation val_reward_margin and val_reward_accuracy.

The reference model is the initial one, and its log-probabilities are computed once, before the first step, in a
first pass over both splits (TRL's precompute_ref_log_probs) on the plain model before any scheme wraps it, with
LoRA's and bottleneck adapters left out (plait.finetune.base_model: the frozen base, no second copy; at the start
it is also the initial model). A frozen copy per rank would cost a model's memory and a forward per step, and
under ZeRO-3 it would be whole where the policy is sharded; the pass costs one forward per pair, once, and what
it leaves is two numbers per pair in the data, which every layout reads alike. The pass splits the pairs in fixed
chunks over the ranks and sums what they found, so every rank holds the same numbers whatever the world size, and
a resumed run computes them again from the same initial weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.callback import Callback
from plait.data.chat import IGNORE
from plait.errors import ConfigError
from plait.finetune import base_model
from plait.parallel import Precision
from plait.train.keys import PREFERENCE_OBJECTIVES

CHUNK = 8  # pairs per forward of the reference pass (fixed: the numbers do not depend on the world size)
# what the metrics window sums: pairs, chosen and rejected rewards, pairs ranked right, chosen and rejected log-probs
FIELDS = ("reward_chosen", "reward_rejected", "reward_accuracy", "logp_chosen", "logp_rejected")


def sequence_logps(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs, 2) log-probabilities of the chosen and rejected completions (sums over their tokens) and (pairs, 2)
    their token counts, from packed rows' logits (pairs, T, vocab) and preference targets (pairs, 3, T)."""
    targets = y[:, :2].long()
    mask = targets != IGNORE
    token = torch.where(mask[:, 0], targets[:, 0], targets[:, 1]).clamp(min=0)  # each place's next token
    logits = logits.float()
    per = logits.gather(-1, token[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)  # TRL's selective_log_softmax
    m = mask.to(per.dtype)
    return (per[:, None] * m).sum(-1), m.sum(-1)


class PreferenceLoss(Callback):
    """The objective's loss (logits, targets) -> the mean over the micro-batch's pairs; as a loop callback, the
    rewards of the pairs it trained on in each logging window (summed over the data-parallel ranks)."""

    def __init__(self, objective: str, beta: float, gamma: float = 0.0, group=None, ranks: int = 1):
        if objective not in PREFERENCE_OBJECTIVES:
            raise ConfigError(f"train.objective = {objective!r} is not a preference objective; choose one of "
                              f"{', '.join(PREFERENCE_OBJECTIVES)}")
        self.objective, self.beta, self.gamma, self.group, self.ranks = objective, beta, gamma, group, ranks
        self.window: torch.Tensor | None = None  # (1 + len(FIELDS),) float64 sums since the last record
        self.last: dict = {}

    def terms(self, logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each pair's loss, (pairs, 2) rewards of its chosen and rejected completions, (pairs, 2) log-probs."""
        logps, counts = sequence_logps(logits, y)
        if self.objective == "simpo":
            mean = logps / counts.clamp(min=1)
            rewards = self.beta * mean
            return -F.logsigmoid(rewards[:, 0] - rewards[:, 1] - self.gamma), rewards.detach(), logps.detach()
        ref = y[:, 2, :2].to(logps.dtype)
        if torch.isnan(ref).any():
            raise RuntimeError("preference pairs without reference log-probabilities: plait.train.preference."
                               "reference_logps fills them before training")
        ratios = logps - ref
        rewards = self.beta * ratios.detach()
        if self.objective == "ipo":  # per token (TRL's, as IPO's authors confirmed to it), then the squared distance
            per = ratios / counts.clamp(min=1)
            return (per[:, 0] - per[:, 1] - 1 / (2 * self.beta)) ** 2, rewards, logps.detach()
        return -F.logsigmoid(self.beta * (ratios[:, 0] - ratios[:, 1])), rewards, logps.detach()

    def __call__(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses, rewards, logps = self.terms(logits, y)
        if torch.is_grad_enabled():  # a training step (evaluation reports through eval_metrics)
            sums = torch.stack([torch.tensor(float(len(losses)), device=rewards.device, dtype=torch.float64),
                                *rewards.double().sum(0), (rewards[:, 0] > rewards[:, 1]).double().sum(),
                                *logps.double().sum(0)])
            self.window = sums if self.window is None else self.window + sums
        return losses.mean()

    def eval_metrics(self) -> dict[str, Callable]:
        """Validation figures, batch means as evaluate() combines them: the reward margin and accuracy."""

        def margin(logits, y):
            rewards = self.terms(logits, y)[1]
            return (rewards[:, 0] - rewards[:, 1]).double().mean()

        def accuracy(logits, y):
            rewards = self.terms(logits, y)[1]
            return (rewards[:, 0] > rewards[:, 1]).double().mean()

        return {"val_reward_margin": margin, "val_reward_accuracy": accuracy}

    def fields(self) -> dict:
        """The window's means over every rank's pairs (one all-reduce, on logging steps, every rank alike)."""
        sums = self.window
        if sums is None:
            return {}
        if self.ranks > 1:
            dist.all_reduce(sums, group=self.group)
        pairs, rc, rr, right, lc, lr = sums.tolist()
        self.window = None
        self.last = {"reward_chosen": rc / pairs, "reward_rejected": rr / pairs, "reward_margin": (rc - rr) / pairs,
                     "reward_accuracy": right / pairs, "logp_chosen": lc / pairs, "logp_rejected": lr / pairs}
        return dict(self.last)

    def summary(self, step: int, final: dict) -> dict:
        return {"preference": {"objective": self.objective, "beta": self.beta, **self.last}} if self.last else {}


@torch.no_grad()
def reference_logps(model, datasets: list, device: torch.device, rank: int = 0, world: int = 1, autocast=None,
                    chunk: int = CHUNK) -> None:
    """Fill each pair's reference log-probabilities (targets[:, 2, :2]) from the model with its adapters left out.

    Every rank of the world calls it with the same plain model: rank k computes chunks k, k + world, ... of each split
    and one all-reduce over the world gives every rank all of them."""
    was = model.training
    model.eval()
    with base_model(model):
        for data in datasets:
            found = torch.zeros(len(data), 2, dtype=torch.float64, device=device)
            for k, lo in enumerate(range(0, len(data), chunk)):
                if k % world != rank:
                    continue
                idx = torch.arange(lo, min(lo + chunk, len(data)))
                x, y = data.fetch(idx)
                with autocast() if autocast is not None else contextlib.nullcontext():
                    logits = model(x.to(device))
                found[idx.to(device)] = sequence_logps(logits, y.to(device))[0].double()
            if world > 1:
                dist.all_reduce(found)
            data.y[:, 2, :2] = found.cpu()
    model.train(was)


def preference_loss(cfg, model, bundle, rt) -> PreferenceLoss:
    """train.objective's loss; dpo and ipo first fill the reference log-probabilities of both splits (every rank)."""
    t = cfg.train
    if t.objective != "simpo":
        world = rt.world_size if rt.distributed else 1
        reference_logps(model, [bundle.train, bundle.val], rt.device, rt.rank if world > 1 else 0, world,
                        Precision(cfg.precision.dtype, rt.device).autocast)
    return PreferenceLoss(t.objective, t.dpo_beta, t.simpo_gamma, rt.axis_group("dp"), rt.group_size("dp"))


def check_preference(cfg, layout) -> None:
    """What preference tuning is built and tested with: a Llama-family model, data parallel and ZeRO 1-3."""
    t, m = cfg.train, cfg.model
    if m.factory or m.hf_class or m.name != "llama":
        what = f"model.factory = {m.factory!r}" if m.factory or m.hf_class else f"model.name = {m.name!r}"
        raise ConfigError(f"train.objective = {t.objective!r} puts a pair's chosen and rejected sequences in one packed "
                          f"row (positions restarting for each), which plait's llama reads; {what} does not: use "
                          "model.name = 'llama' or a Llama-family train.init_from (Llama, Qwen2, Mistral, Mixtral)")
    if not layout.data_parallel_only:
        raise ConfigError(f"train.objective = {t.objective!r} is tested with data parallel and ZeRO 1-3 only (here tp = "
                          f"{layout.tp}, pp = {layout.pp}, cp = {layout.cp}, ep = {layout.ep}, sync = {layout.sync!r}); "
                          "set those to 1 and 'allreduce'")
    other = [k for k, on in (("train.loss", t.loss), ("data.curriculum", cfg.data.curriculum),
                             ("data.stream", cfg.data.stream), ("data.sampler = 'balanced'", cfg.data.sampler != "shuffle"),
                             ("model.ensemble", m.ensemble > 1)) if on]
    if other:
        raise ConfigError(f"train.objective = {t.objective!r} scores pairs with its own loss; {', '.join(other)} cannot "
                          "apply to them: turn it off")
