"""Context parallel: every sequence's tokens split over the ranks of a cp group; attention runs as a ring.

    plait train --set parallel.cp=2                               # alone, or with dp, tp, pp and ZeRO 1-3
    plait train --set parallel.dp=2 --set parallel.cp=2 --set parallel.zero=3

Long sequences run out of activation memory, not parameters: whatever dp, tp, pp or ZeRO do, every rank
holds the activations of whole sequences. Here each rank of a cp group holds T / cp of every sequence's
tokens (torchtitan's and Megatron-LM's context parallelism), so every activation of the blocks, attention's
and the MLP's, is 1 / cp of its size at cp = 1.

The layout is zig-zag ("load-balanced"): a sequence of T tokens is cut into 2 cp chunks and cp rank i holds
chunks i and 2 cp - 1 - i. Under a causal mask chunk c sees chunks 0..c, so each rank's two chunks see
2 cp + 1 chunks' worth of keys between them, the same on every rank (contiguous chunks would give rank i
4 i + 3, the last rank twice the average).

What changes for a step: each micro-batch (inputs, targets) is cut before the strategy sees it (`shard`): the
inputs become rows of (ids, positions, global index, document id) of this rank's tokens, the targets this
rank's targets. A forward pre-hook on the model keeps the index and document rows for this forward's
attention and hands the model (ids, positions), the packed-rows input plait's GPT and Llama read: learned and
rotary positions alike see each token's position in its sequence (restarting per document in packed rows).
Each attention module's `sdpa` is replaced by a RingCore, which runs ring attention (plait.comm.ring_attention)
on such a forward, confined to each document, and plain SDPA on any other: evaluation and generation read
whole sequences, one per rank, as at cp = 1.

Gradients need nothing new: the ranks of a cp group are replicas on the mesh's dp axis (plait.parallel.layout),
so DDP, ZeRO 1-3 and FSDP average over dp * cp ranks, and each rank's loss is the mean over its own T / cp
tokens, so that average is the global batch's mean, step for step the one-process trajectory.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.comm.ring_attention import ring_attention
from plait.data.chat import IGNORE
from plait.errors import ConfigError
from plait.models.moe import moe_layers
from plait.parallel.scheme import Build
from plait.parallel.schemes.context import attention_modules

ROWS = 4  # a context-parallel input: ids, positions, global index, document id (each row this rank's tokens)


def zigzag(t: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The indices in a sequence of t tokens of those cp rank `rank` holds: chunks rank and 2 cp - 1 - rank of 2 cp."""
    size = t // (2 * cp)
    first, second = rank * size, (2 * cp - 1 - rank) * size
    return torch.cat([torch.arange(first, first + size, device=device),
                      torch.arange(second, second + size, device=device)])


def contiguous(t: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The naive layout, for comparison: rank i holds the i-th of cp consecutive pieces."""
    size = t // cp
    return torch.arange(rank * size, (rank + 1) * size, device=device)


def shard(x: torch.Tensor, y: torch.Tensor, cp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens of a micro-batch: inputs (batch, ROWS, t / cp) and targets (batch, t / cp).

    x: ids (batch, t), or packed rows (batch, 2, t) of ids and positions, a document starting wherever the
    position is 0 (plait.models.decoder.packed_mask reads them the same way).
    """
    if x.dim() == 3:
        ids, pos = x[:, 0], x[:, 1]
        doc = (pos == 0).cumsum(1)
    else:
        ids = x
        pos = torch.arange(x.shape[1], device=x.device).expand_as(x)
        doc = torch.zeros_like(x)
    t = ids.shape[1]
    keep = zigzag(t, cp, rank, x.device)
    index = torch.arange(t, device=x.device).expand_as(ids)
    return torch.stack([ids, pos, index, doc], 1)[:, :, keep].contiguous(), y[:, keep].contiguous()


class _Forward:
    """What the model's pre-hook leaves for its attention modules: (2, batch, t) global index and document id of
    this forward's tokens, or None for a forward of whole sequences."""

    meta: torch.Tensor | None = None


class RingCore:
    """An attention module's `sdpa` under context parallel: ring attention on a cp forward, SDPA on any other."""

    def __init__(self, forward: _Forward, group, window: int = 0, stats: dict | None = None):
        self.forward, self.group, self.window = forward, group, window
        self.stats = stats  # the ring's compute and exposed-wait seconds (plait.comm.ring_attention), when given

    def __call__(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        meta = self.forward.meta
        if meta is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                                  scale=scale, enable_gqa=enable_gqa)
        # The model built its mask from this rank's positions alone: the ring's own comes from the global index
        # and documents (causal: plait's language models are decoders; check_model admits no other).
        return ring_attention(q, k, v, meta, meta, self.group, causal=True, window=self.window, scale=scale,
                              stats=self.stats)

    def __deepcopy__(self, memo):  # a copied model (an EMA, a teacher) shares the ring: its group cannot be copied
        return self


def apply_cp(model: nn.Module, group, stats: dict | None = None, hidden: tuple[int, int, int] | None = None) -> nn.Module:
    """Ring attention in every attention module of `model`, on the forwards whose inputs `shard` cut (stats: see
    plait.comm.ring_attention.ring_attention).

    hidden = (t, cp, rank): a later pipeline stage, whose input is the hidden states of this rank's tokens of
    sequences of t tokens (no documents: every token's place is its zig-zag index); they get those positions too
    (`pos`, where the model's forward takes them: rotary positions are applied in every block).
    """
    state = _Forward()
    for m in attention_modules(model):
        setattr(m, "sdpa", RingCore(state, group, getattr(m, "window", 0), stats))  # noqa: B010 (a plain attribute)
    for m in moe_layers(model):  # the load-balancing loss's expert shares are the whole sequence's
        m.cp_group = group
    index = None if hidden is None else zigzag(*hidden)
    takes_pos = "pos" in inspect.signature(model.forward).parameters

    def enter(module, args, kwargs):
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] == ROWS and not x.is_floating_point():
            state.meta = x[:, 2:].transpose(0, 1).contiguous()
            return (x[:, :2], *args[1:]), kwargs
        if (index is not None and isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() == 3
                and x.shape[1] == len(index)):
            at = index.to(x.device).expand(x.shape[0], -1)
            state.meta = torch.stack([at, torch.zeros_like(at)])
            return (args, kwargs | {"pos": at}) if takes_pos else None
        state.meta = None
        return None

    model.register_forward_pre_hook(enter, with_kwargs=True)
    return model


def transform(model: nn.Module, b: Build) -> nn.Module:
    hidden = (b.cfg.model.context, b.layout.cp, b.rt.axis_rank("cp")) if b.layout.pp > 1 else None
    return apply_cp(model, b.rt.context_mesh.get_group(), hidden=hidden)


def masked_rows(cfg) -> bool:
    """Targets masked to the answers (chat data) under plait's own loss: a row's loss is the mean over its trained
    tokens, which a cp group's ranks hold unevenly, so a cut row carries the whole row's count."""
    return cfg.data.name == "chat" and not cfg.train.loss


def batches(b: Build):
    """Each micro-batch cut to this rank's tokens, before the strategy sees it; with masked targets, each row's
    targets followed by the number of trained tokens in the whole row (one more column, which `loss` takes off)."""
    cp, rank, context = b.layout.cp, b.rt.axis_rank("cp"), b.cfg.model.context
    counts = masked_rows(b.cfg)

    def cut(batch):
        x, y = batch
        if b.layout.pp > 1 and (x.dim() == 3 or x.shape[-1] != context):
            # a later stage knows its tokens' places only as the zig-zag index of a whole row (apply_cp's hidden)
            raise ConfigError(f"parallel.cp = {cp} with parallel.pp = {b.layout.pp} takes rows of model.context = "
                              f"{context} tokens without documents; these are {tuple(x.shape)}: set parallel.pp=1 "
                              "(or parallel.cp=1)")
        x_cut, y_cut = shard(x, y, cp, rank)
        if counts:
            y_cut = torch.cat([y_cut, (y != IGNORE).sum(1, keepdim=True)], 1)
        return x_cut, y_cut

    return cut


def loss(inner, b: Build):
    """With masked targets, this rank's share of each row's mean over its trained tokens: the sum of its own tokens'
    losses over the whole row's count, times cp (the dp axis averages over the cp ranks, whose shares add up to the
    row's mean). Whole rows (evaluation) take the loss as it is."""
    if not masked_rows(b.cfg):
        return inner
    cp = b.layout.cp

    def cut_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if targets.shape[-1] != outputs.shape[1] + 1:
            return inner(outputs, targets)
        y, trained = targets[:, :-1], targets[:, -1]
        per = F.cross_entropy(outputs.flatten(0, 1).float(), y.flatten(), reduction="none").view(y.shape)
        local = (per.sum(1) / (y != IGNORE).sum(1).clamp(min=1)).mean()  # the inner loss's own term, on these tokens
        share = cp * (per.sum(1) / trained.clamp(min=1)).mean()
        return inner(outputs, y) - local + share  # what the inner loss adds (an MoE's balancing term) is kept

    return cut_loss
