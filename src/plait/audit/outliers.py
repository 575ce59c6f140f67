"""Outliers by the distance to the k-th nearest neighbour on the first principal components, on one process or
scaled across the ranks of a process group (each rank holding a shard of the samples).

Across ranks nothing but statistics and embeddings moves: the mean and the scatter matrix are all-reduced (float64),
every rank takes the same eigenvectors, embeds its own shard, and the shards' embeddings go round a ring: at each
of world steps a rank measures its samples against the block it holds, keeps each sample's k + 1 smallest
distances (its own 0 included) and passes the block on. The scores are all-gathered and every rank flags the same
samples. With one process it is the same arithmetic, so `plait data audit` and a job of N ranks flag the same
samples (tests/audit/test_outliers.py).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

OUTLIER_FRACTION = 0.01


def _components(mean: torch.Tensor, scatter: torch.Tensor, n: int) -> torch.Tensor:
    """The top principal directions (columns), each signed so that its largest entry is positive (deterministic)."""
    values, vectors = torch.linalg.eigh(scatter / max(1, n - 1))
    keep = min(50, scatter.shape[0], n)
    v = vectors[:, torch.argsort(values, descending=True, stable=True)[:keep]]
    signs = torch.sign(v.gather(0, v.abs().argmax(0, keepdim=True)))
    return v * torch.where(signs == 0, torch.ones_like(signs), signs)


def _merge(best: torch.Tensor, d: torch.Tensor, k: int) -> torch.Tensor:
    return torch.cat([best, d], 1).topk(min(k + 1, best.shape[1] + d.shape[1]), dim=1, largest=False).values


def kth_distances(x_local: torch.Tensor, k: int = 5, group=None) -> torch.Tensor:
    """Each local sample's distance to its k-th nearest neighbour among all ranks' samples (itself excluded)."""
    world = dist.get_world_size(group) if group is not None or dist.is_initialized() else 1
    flat = x_local.reshape(len(x_local), -1).double()
    stats = torch.cat([torch.tensor([float(len(flat))], dtype=torch.float64), flat.sum(0)])
    if world > 1:
        dist.all_reduce(stats, group=group)
    n = int(stats[0])
    mean = stats[1:] / n
    centred = flat - mean
    scatter = centred.T @ centred
    if world > 1:
        dist.all_reduce(scatter, group=group)
    emb = centred @ _components(mean, scatter, n)
    k = min(k, n - 1)
    best = torch.full((len(emb), 0), float("inf"), dtype=torch.float64)
    block = emb
    if world > 1:
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([len(emb)]), group=group)
        rank = dist.get_rank(group)
    for step in range(world):
        best = _merge(best, torch.cdist(emb, block), k)
        if step == world - 1:
            break
        src = (rank - step - 1) % world  # whose block arrives next
        incoming = torch.empty(int(sizes[src]), emb.shape[1], dtype=torch.float64)
        ops = [dist.P2POp(dist.isend, block.contiguous(), (rank + 1) % world, group),
               dist.P2POp(dist.irecv, incoming, (rank - 1) % world, group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        block = incoming
    return best[:, k]


def flag(scores: torch.Tensor, src: torch.Tensor, k: int) -> dict:
    """The OUTLIER_FRACTION of samples with the largest scores, farthest first."""
    score = scores.numpy()
    flagged = np.argsort(-score, kind="stable")[: max(1, int(round(OUTLIER_FRACTION * len(score))))]
    return {"method": f"distance to the {k}-th nearest neighbour on the first principal components, the farthest "
                      f"{OUTLIER_FRACTION:.0%}",
            "indices": [int(src[i]) for i in flagged], "scores": [round(float(score[i]), 4) for i in flagged]}


def outliers_across_ranks(x_local: torch.Tensor, src: torch.Tensor, k: int = 5, group=None) -> dict:
    """outliers() for a group whose ranks each hold a contiguous shard, in rank order; src: every sample's source
    index (the whole list, the same on every rank). Every rank returns the same flags."""
    scores = kth_distances(x_local, k, group)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world > 1:
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([len(scores)]), group=group)
        most = int(max(sizes))
        parts = [torch.empty(most, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(parts, torch.cat([scores, scores.new_zeros(most - len(scores))]), group=group)
        scores = torch.cat([p[:int(s)] for p, s in zip(parts, sizes)])
    return flag(scores, src, min(k, len(src) - 1))
