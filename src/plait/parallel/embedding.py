"""Model-parallel embedding tables (DLRM / TorchRec style) with a data-parallel dense part.

Recommendation models are mostly embedding tables of very different sizes; replicating them on
every rank wastes the memory that matters. Here the tables are sharded over the dp ranks:

    table   whole tables, each on one rank (greedy by size, so ranks hold similar bytes)
    row     every table split by rows: rank r holds rows [r*c, (r+1)*c), c = ceil(rows / N)
            (a DTensor sharded on dim 0, so checkpoints reshard like any other)

One lookup, for either layout: all-gather the ids of the global batch, look up the rows this rank
holds (zeros elsewhere), and reduce-scatter over the batch dimension: each rank receives its own
samples' embeddings, summed over the ranks that hold a piece of them. Backward is the reverse
(all-gather of the gradients; the owner's table gets every rank's contribution, averaged over
ranks like the dense part, whose gradients are all-reduced).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor

from plait.comm.placement import balanced_owners
from plait.parallel.base import Strategy
from plait.parallel.gradsync import allreduce_grads, clip_grad_norm
from plait.parallel.scheme import Build


class _ReduceScatterBatch(torch.autograd.Function):
    """(B, ...) partial sums on every rank -> this rank's (B / N, ...) slice of their total."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group, n: int) -> torch.Tensor:
        ctx.group, ctx.n = group, n
        out = partial.new_empty((partial.shape[0] // n, *partial.shape[1:]))
        dist.reduce_scatter_single(out, partial.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        full = grad.new_empty((grad.shape[0] * ctx.n, *grad.shape[1:]))
        dist.all_gather_single(full, grad.contiguous(), group=ctx.group)
        return full / ctx.n, None, None  # averaged over ranks, as the dense gradients are


class ShardedEmbeddings(nn.Module):
    """Drop-in for an EmbeddingCollection: same parameter names, this rank's share of the rows."""

    def __init__(self, collection: nn.Module, mode: str, dp_mesh):
        super().__init__()
        self.mode, self.mesh = mode, dp_mesh
        self.group = dp_mesh.get_group()
        self.n, self.rank = dp_mesh.size(), dp_mesh.get_local_rank()
        tables = cast(nn.ModuleDict, collection.tables)
        self.fields = len(tables)
        embeds = [cast(nn.Embedding, tables[str(i)]) for i in range(self.fields)]
        self.rows = [e.num_embeddings for e in embeds]
        self.dim = embeds[0].embedding_dim
        self.tables = nn.ModuleDict()
        if mode == "table":
            owner = balanced_owners([r * self.dim for r in self.rows], self.n)
            self.owned = [i for i in range(self.fields) if owner[i] == self.rank]
            for i in self.owned:
                self.tables[str(i)] = tables[str(i)]
        else:
            self.owned = list(range(self.fields))
            for i in self.owned:
                holder = nn.Module()
                holder.weight = nn.Parameter(distribute_tensor(tables[str(i)].weight.detach(), dp_mesh, [Shard(0)]))
                self.tables[str(i)] = holder

    def _lookup(self, i: int, ids: torch.Tensor) -> torch.Tensor:
        if self.mode == "table":
            return self.tables[str(i)](ids)
        local = self.tables[str(i)].weight.to_local()
        lo = self.rank * -(-self.rows[i] // self.n)
        mask = (ids >= lo) & (ids < lo + local.shape[0])
        rows = F.embedding((ids - lo).clamp(0, max(0, local.shape[0] - 1)), local) if local.shape[0] else \
            local.new_zeros((*ids.shape, self.dim))
        return rows * mask.unsqueeze(-1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        everyone = ids.new_empty((ids.shape[0] * self.n, ids.shape[1]))
        dist.all_gather_single(everyone, ids.contiguous(), group=self.group)
        zeros = None
        cols = []
        for i in range(self.fields):
            if i in self.owned:
                cols.append(self._lookup(i, everyone[:, i]))
            else:
                if zeros is None:
                    zeros = torch.zeros(everyone.shape[0], self.dim, device=ids.device)
                cols.append(zeros)
        partial = torch.stack(cols, 1)
        if torch.is_grad_enabled() and not partial.requires_grad:
            # A rank that holds no rows still has to join backward's all-gather with the others.
            partial.requires_grad_()
        return _ReduceScatterBatch.apply(partial, self.group, self.n)


def apply_embedding_sharding(model: nn.Module, mode: str, dp_mesh) -> nn.Module:
    if model.embed is not None:  # a pipeline stage after the first holds no tables
        model.embed = ShardedEmbeddings(cast(nn.Module, model.embed), mode, dp_mesh)
    return model


def dp_sharded_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the sharded tables in `model` (a pipeline stage's): each dp rank holds its own share."""
    return [p for m in model.modules() if isinstance(m, ShardedEmbeddings) for p in m.parameters()]


def gather_over_dp(sd: dict, group, n: int) -> dict:
    """A full state dict from every dp rank's (whole tables live on their owner only)."""
    parts: list = [None] * n
    dist.all_gather_object(parts, sd, group=group)
    out: dict = {}
    for p in parts:
        out.update(p)
    return out


class EmbeddingShardStrategy(Strategy):
    name = "sharded-embeddings"
    sharded = True

    def __init__(self, *args, rt, mode: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.name = f"{mode}-sharded-embeddings"
        self.rt, self.group, self.n = rt, rt.axis_group("dp"), rt.axis_size("dp")
        emb = set(map(id, self.module.embed.parameters()))
        self.dense = [p for p in self.module.parameters() if id(p) not in emb]
        self.sharded_params = [p for p in self.module.parameters() if id(p) in emb]

    def after_backward(self) -> None:
        allreduce_grads(self.dense, self.group, self.n)

    def clip_grad_norm(self, max_norm: float, need_norm: bool = True):
        """Dense gradients are replicated (count once); each embedding row lives on one rank (sum over ranks)."""
        self.precision.unscale(self.optimizer, self.group)
        if max_norm <= 0 and not need_norm:
            return None
        local = [_Local(p) for p in self.sharded_params]  # row shards count by their pieces, not as DTensors
        return clip_grad_norm(self.dense, max_norm, partial=local, group=self.group)

    def full_model_state_dict(self) -> dict:
        sd = super().full_model_state_dict()  # row shards become whole tables; whole tables stay on their owner
        return gather_over_dp(sd, self.group, self.n)


class _Local:
    """A parameter seen through its local piece (a row-sharded table's rows on this rank)."""

    def __init__(self, param):
        g = param.grad
        self.grad = g.to_local() if g is not None and hasattr(g, "to_local") else g


def build(b: Build) -> Strategy:
    model = b.parallelize(b.module)
    return EmbeddingShardStrategy(model, b.module, b.make_optimizer(b.module), b.loss_fn, b.precision, b.local_batch,
                                  rt=b.rt, mode=b.layout.embedding_sharding)


def transform(model: nn.Module, b: Build) -> nn.Module:
    return apply_embedding_sharding(model, b.layout.embedding_sharding, b.rt.mesh["dp"])
