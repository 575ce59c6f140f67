"""Gradient plumbing shared by layouts that DDP cannot wrap (tensor-parallel DTensors, pipeline stages).

`allreduce_grads` averages gradients over the dp axis in one flat all-reduce after backward.
`clip_grad_norm` computes the global norm over plain and DTensor gradients alike (and over the
pipeline stages, which hold different parameters), then clips: the same number as
torch.nn.utils.clip_grad_norm_ on the single-process model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def align_grads(params) -> None:
    """Give every DTensor gradient its parameter's placements.

    A vocabulary-parallel embedding's weight gradient comes back Replicate while the weight is
    Shard(0); synchronising such gradients by their local pieces needs the two to agree.
    Replicate -> Shard is a local slice, no communication.
    """
    for p in params:
        g = p.grad
        if g is not None and hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)


def allreduce_grads(params, group, size: int) -> None:
    """Average every gradient over `group` (size ranks) with one flat all-reduce."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if not grads or size == 1:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat.div_(size)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def _norm_sq(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of a list of gradients; DTensors are reduced over their mesh (full value on every rank)."""
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    plain = [g for g in grads if not hasattr(g, "full_tensor")]
    if plain:
        total += torch.stack([n.double() for n in torch._foreach_norm(plain)]).pow(2).sum()
    for g in grads:
        if hasattr(g, "full_tensor"):
            total += g.norm().full_tensor().double().pow(2)
    return total


def clip_grad_norm(params, max_norm: float, pp_group=None, skip_in_norm: frozenset[int] = frozenset()) -> torch.Tensor:
    """Clip the global gradient norm to max_norm; returns the norm before clipping (float32 scalar).

    skip_in_norm: ids of parameters that are copies of one counted elsewhere (a tied weight held
    by two pipeline stages), clipped but counted once.
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    counted = [p.grad for p in params if id(p) not in skip_in_norm]
    sq = _norm_sq(counted) if counted else torch.zeros((), dtype=torch.float64, device=params[0].grad.device)
    if pp_group is not None:
        dist.all_reduce(sq, group=pp_group)
    norm = sq.sqrt().float()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        _local(p.grad).mul_(coef.to(p.grad.device))
    return norm
