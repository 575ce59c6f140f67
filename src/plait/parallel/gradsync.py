"""Gradient plumbing every layout shares: one global-norm clip, one by-hand data-parallel average.

`clip_grad_norm` is the only gradient clipping in plait. Whatever the layout, it returns the norm
torch.nn.utils.clip_grad_norm_ returns on the single-process model, and scales every gradient by
the same factor:

* plain tensors that every rank of a group holds whole (data parallel) count once;
* DTensor gradients (tensor parallel, FSDP2) count as their full tensors, one reduction per
  (mesh, placements) family rather than one per parameter;
* `partial` parameters are pieces that other ranks of `group` do not hold (ZeRO-1's owned
  segments, row-sharded embedding tables, a pipeline stage's own parameters): their squares are
  summed over `group`;
* `clip_also` are copies of a parameter counted elsewhere (a tied weight held by two pipeline
  stages): clipped, not counted.

`allreduce_grads` averages gradients over the dp axis in one flat all-reduce, for layouts that
DDP cannot wrap (tensor-parallel DTensors, pipeline stages, sharded embeddings).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

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


def allreduce_grads(params, group, size: int, dtype: torch.dtype | None = None) -> None:
    """Average every gradient over `group` (size ranks) with one flat all-reduce (in `dtype`: compressed)."""
    average_tensors([_local(p.grad) for p in params if p.grad is not None], group, size, dtype)


def average_tensors(grads: list[torch.Tensor], group, size: int, dtype: torch.dtype | None = None) -> None:
    """Average these tensors over `group` (size ranks) in place, with one flat all-reduce. With `dtype` (fp16/bf16
    compression) the flat buffer is cast, divided by `size`, summed in that dtype and cast back: torch's
    fp16_compress_hook's arithmetic, so a tensor-parallel model's shards compress as a DDP bucket does."""
    if not grads or size == 1:
        return
    flat = _flatten_dense_tensors(grads)
    if dtype is not None:
        half = flat.to(dtype).div_(size)
        dist.all_reduce(half, group=group)
        flat.copy_(half)
    else:
        dist.all_reduce(flat, group=group)
        flat.div_(size)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def norm_sq(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares (float64) of full gradients; DTensors are reduced over their meshes, one family at a time."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    plain = [g for g in grads if not hasattr(g, "full_tensor")]
    if plain:
        total += torch.stack(torch._foreach_norm(plain)).double().pow(2).sum()
    families: dict[tuple, list[Any]] = {}  # DTensor gradients
    for d in grads:
        g: Any = d
        if hasattr(g, "full_tensor"):
            families.setdefault((id(g.device_mesh), tuple(g.placements)), []).append(g)
    for family in families.values():
        norms: Any = torch.stack(torch._foreach_norm(family))  # a DTensor, partial where the gradients are sharded
        total += norms.full_tensor().double().pow(2).sum()
    return total


def clip_grad_norm(params: Iterable, max_norm: float, *, partial: Iterable = (), group=None,
                   clip_also: Iterable = ()) -> torch.Tensor:
    """Global gradient norm (float32 scalar) of params + partial; clips every gradient to max_norm when it is > 0."""
    grads = lambda ps: [p.grad for p in ps if p.grad is not None]  # noqa: E731
    return clip_grads(grads(params), max_norm, partial=grads(partial), group=group, clip_also=grads(clip_also))


def clip_grads(whole: list[torch.Tensor], max_norm: float, *, partial: Sequence[torch.Tensor] = (), group=None,
               clip_also: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """clip_grad_norm on gradient tensors: `whole` counted once, `partial` summed over `group`, `clip_also` not counted."""
    every = [*whole, *partial, *clip_also]
    if not every and group is None:
        return torch.zeros(())
    device = _local(every[0]).device if every else torch.device("cpu")  # a rank with nothing still joins the sum
    sq = norm_sq(list(whole), device)
    if partial or group is not None:
        shard_sq = norm_sq(list(partial), device)
        if group is not None:
            dist.all_reduce(shard_sq, group=group)
        sq = sq + shard_sq
    norm = sq.sqrt().float()
    clip_to(every, norm, max_norm)
    return norm


def clip_to(grads: Sequence[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale the gradients by max_norm / norm where their (already global) norm is above max_norm > 0."""
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_([_local(g) for g in grads], coef.to(_local(grads[0]).device))
