"""Validation and the end-of-run figures, layout-independent: the same figures from any layout or one process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.data import DataBundle
from plait.data.datasets import eval_batches
from plait.models import build_model
from plait.models.fewshot import episode_accuracy
from plait.models.vlm import zero_shot_accuracy


def evaluate(strategy, dataset, cfg, rt, task: str) -> dict:
    """Validation loss (and accuracy) on the fixed validation set.

    Each fixed-size batch is evaluated whole on one dp rank and the per-batch figures are
    combined in float64 in batch order, so the result does not depend on the layout and a
    single process with the exported weights reproduces it. Ranks without a process group (a
    parameter server's chief) evaluate every batch themselves.
    """
    batches = eval_batches(dataset, cfg.train.eval_samples, cfg.train.eval_batch_size)
    if not batches:  # train.eval_samples = 0: no evaluation, so no figures (not a NaN loss)
        return {}
    losses = torch.zeros(len(batches), dtype=torch.float64)
    correct = torch.zeros(len(batches), dtype=torch.float64)
    names = list(strategy.eval_metrics or {})  # train.eval_metrics: batch means, combined as the loss
    extra = torch.zeros(len(names), len(batches), dtype=torch.float64)
    # the ranks that share out the batches (a spread ensemble's: one rank of each member takes the same batch)
    axis = getattr(strategy, "eval_axis", "dp")
    dp = rt.group_size(axis)
    r = rt.axis_rank(axis) if dp > 1 else 0
    copies = rt.group_size("dp") // dp  # ranks that evaluate each batch, all alike: the sum below counts it so often
    model = strategy.model
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for k in range(-(-len(batches) // dp)):
            i = k * dp + r
            if i >= len(batches):
                # Sharded parameters are gathered collectively: every rank runs as many forwards.
                x, y = dataset.fetch(batches[0])
                strategy.eval_batch(x.to(rt.device), y.to(rt.device))
                continue
            x, y = dataset.fetch(batches[i])
            loss, right = strategy.eval_batch(x.to(rt.device), y.to(rt.device))
            losses[i], correct[i] = loss.cpu(), right.cpu()
            if names:
                extra[:, i] = strategy.last_metrics.cpu()
    model.train(was_training)
    if rt.group_size("dp") > 1:
        both = torch.cat([torch.stack([losses, correct]), extra]).to(rt.device)
        dist.all_reduce(both, group=rt.axis_group("dp"))
        both /= copies
        losses, correct, extra = both[0].cpu(), both[1].cpu(), both[2:].cpu()
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    out = {"val_loss": float((losses * sizes).sum() / sizes.sum())}
    for name, values in zip(names, extra):
        out[name] = float((values * sizes).sum() / sizes.sum())
    if task in ("classification", "binary", "fewshot"):
        out["val_accuracy"] = float(correct.sum() / sizes.sum())
    return out


def whole_model_on_main(strategy, bundle: DataBundle, cfg, rt):
    """The trained weights in a plain model on rank 0 (None elsewhere); gathering them is a collective."""
    weights = strategy.full_model_state_dict()
    if not rt.is_main:
        return None
    module = build_model(cfg.model, bundle.spec)
    module.load_state_dict(weights)
    return module


def linear_probe(strategy, bundle: DataBundle, cfg, rt, samples: int = 2000) -> float | None:
    """Contrastive runs: accuracy of a logistic regression on the frozen encoder's features (train split -> val split).

    The weights are gathered into a plain model first (a collective: every rank calls this); rank 0 fits
    scikit-learn's LogisticRegression on the un-augmented training samples and scores the validation ones.
    """
    if bundle.spec.task != "contrastive":
        return None
    module = whole_model_on_main(strategy, bundle, cfg, rt)
    if module is None:
        return None
    from sklearn.linear_model import LogisticRegression  # lazily: only rank 0 at the end needs scikit-learn

    module.eval()

    def features(views) -> tuple:
        data = views.dataset  # the plain samples under the views
        idx = torch.arange(min(samples, len(data)))
        x, y = data.fetch(idx)
        with torch.no_grad():
            return module.embed(x).numpy(), y.numpy()

    (xt, yt), (xv, yv) = features(bundle.train), features(bundle.val)
    probe = LogisticRegression(max_iter=2000).fit(xt, yt)
    return float(probe.score(xv, yv))


def fewshot_from_scratch(bundle: DataBundle, cfg, rt) -> dict | None:
    """Meta-learning runs: the held-out episodes' accuracy when the same inner steps start from a fresh initialisation
    instead of the meta-learned one (the baseline meta-learning must beat), on rank 0, with the episode settings."""
    if bundle.spec.task != "fewshot" or not rt.is_main:
        return None

    e = bundle.spec.episode
    torch.manual_seed(cfg.train.seed + 1)  # not the meta-learned model's initialisation
    fresh = build_model(cfg.model, bundle.spec)
    return {"ways": e["ways"], "shots": e["shots"], "queries": e["queries"], "algorithm": e["algorithm"],
            "inner_steps": e["inner_steps"], "inner_lr": e["inner_lr"], "episodes": cfg.train.eval_samples,
            "scratch_val_accuracy": episode_accuracy(fresh, bundle.val, cfg.train.eval_samples)}


def multimodal_figures(strategy, bundle: DataBundle, cfg, rt) -> dict | None:
    """model.name = 'vlm': the zero-shot classification accuracy on the validation images (rank 0, from the whole
    weights: a collective, every rank calls this), with the connector and what trained."""
    if cfg.model.name != "vlm" or cfg.model.factory:
        return None
    module = whole_model_on_main(strategy, bundle, cfg, rt)
    if module is None:
        return None

    trainable = sum(p.numel() for p in strategy.module.parameters() if p.requires_grad)
    return {"connector": cfg.model.connector, "frozen": list(cfg.finetune.freeze), "trainable_params": trainable,
            "zero_shot_accuracy": zero_shot_accuracy(module, bundle.val, cfg.train.eval_samples)}
