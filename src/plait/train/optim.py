"""Optimizers and the learning-rate schedule (a pure function of the step, so resuming needs only the step)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def param_groups(model: nn.Module, weight_decay: float, only: set[int] | None = None) -> list[dict]:
    """Matrices and embeddings decay; biases and norm scales do not. `only`: ids of the parameters to include."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad and (only is None or id(p) in only):
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": ps, "weight_decay": wd} for ps, wd in ((decay, weight_decay), (no_decay, 0.0)) if ps]
    if not groups:
        raise ValueError("no trainable parameters to optimize")
    return groups


def build_optimizer(model: nn.Module, optim_cfg, only: set[int] | None = None) -> torch.optim.Optimizer:
    """The configured optimizer over the model's parameters that train (or the subset `only`, by id)."""
    groups = param_groups(model, optim_cfg.weight_decay, only)
    betas = tuple(optim_cfg.betas)
    fused = {"fused": True} if optim_cfg.fused else {}
    if optim_cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=betas, eps=optim_cfg.eps, **fused)
    if optim_cfg.name == "lamb":
        return Lamb(groups, lr=optim_cfg.lr, betas=betas, eps=optim_cfg.eps)
    if optim_cfg.name == "lars":
        return Lars(groups, lr=optim_cfg.lr, momentum=optim_cfg.momentum, trust_coefficient=optim_cfg.trust_coefficient)
    if optim_cfg.name == "adamw8bit":
        from torchao.optim import AdamW8bit  # optional dependency (plait[lowbit]); imported only when configured

        return AdamW8bit(groups, lr=optim_cfg.lr, betas=betas, eps=optim_cfg.eps)
    return torch.optim.SGD(groups, lr=optim_cfg.lr, momentum=optim_cfg.momentum, **fused)


def peak_lr(optim_cfg, global_batch_size: int = 0) -> float:
    """optim.lr scaled by global_batch_size / base_batch_size: linearly (Goyal et al. 2017) or by its square root
    (Krizhevsky 2014); unscaled with lr_scaling = 'none' (or no batch size given)."""
    if optim_cfg.lr_scaling == "none" or not global_batch_size:
        return optim_cfg.lr
    ratio = global_batch_size / optim_cfg.base_batch_size
    return optim_cfg.lr * (ratio if optim_cfg.lr_scaling == "linear" else math.sqrt(ratio))


def lr_at(step: int, optim_cfg, total_steps: int, global_batch_size: int = 0) -> float:
    """Linear warmup to the peak lr (peak_lr) over warmup_steps, then cosine decay to min_lr_ratio * peak at total_steps."""
    peak = peak_lr(optim_cfg, global_batch_size)
    if optim_cfg.warmup_steps and step < optim_cfg.warmup_steps:
        return peak * (step + 1) / optim_cfg.warmup_steps
    if optim_cfg.schedule == "constant":
        return peak
    span = max(1, total_steps - optim_cfg.warmup_steps)
    progress = min(1.0, (step - optim_cfg.warmup_steps) / span)
    floor = peak * optim_cfg.min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):  # torchao's low-bit optimizers keep lr as a (CPU) tensor
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020): Adam's bias-corrected direction plus decoupled weight decay, scaled per tensor by
    the trust ratio |w| / |u| (1 where either norm is 0).

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * w
        w = w - lr * (|w| / |u|) * u

    The ratio stays a tensor (torch.where, no .item()), so a step adds no host-device sync.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                t = state["step"]
                u = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + group["eps"])
                if group["weight_decay"]:
                    u = u + group["weight_decay"] * p
                p.sub_(group["lr"] * _trust(p.norm(), u.norm()) * u)
        return loss


class Lars(torch.optim.Optimizer):
    """LARS (You et al. 2017): SGD with momentum whose rate is scaled per tensor by eta |w| / (|g| + wd |w|).

        local = trust_coefficient * |w| / (|g| + weight_decay * |w|)   (1 where |w| or |g| is 0)
        buf = momentum * buf + lr * local * (g + weight_decay * w)
        w = w - buf
    """

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            wd = group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                w_norm, g_norm = p.norm(), g.norm()
                local = _trust(group["trust_coefficient"] * w_norm, g_norm + wd * w_norm)
                d = g + wd * p if wd else g
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(group["lr"] * local * d)
                p.sub_(buf)
        return loss


def _trust(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, or 1 where either is 0 (a fresh zero tensor, or a zero update)."""
    ok = (num > 0) & (den > 0)
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.ones_like(num))
