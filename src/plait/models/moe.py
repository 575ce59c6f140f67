"""Mixture of experts: a top-k routed feed-forward layer (Switch Transformer, GShard) that plait can spread over ranks.

    moe = MoE(width=128, hidden=512, experts=8, top_k=2, capacity_factor=1.25)
    y = moe(x)              # x (..., tokens, width) -> the same shape; the surrounding block adds the residual
    moe.aux_loss            # the last training forward's load-balancing loss (None after an evaluation forward)

Routing is a function of the token and the weights only. A linear router gives each token a softmax
over the E experts; the token goes to its top_k experts, weighted by its probability (top-1, as
Switch does) or by its probabilities renormalised over the k chosen (top-k > 1, as GShard and
Mixtral do), and the layer's output is the gated sum of those experts' MLPs.

Groups and capacity. Tokens are routed in groups (GShard's local groups): one group is one sequence
(the second-to-last dimension of x; a 2-D input (tokens, width) is a single group). With
capacity_factor c > 0 each expert takes at most C = ceil(c * T * k / E) of a group's T tokens'
assignments in training, first choices before second choices and earlier tokens first; the others
are dropped (they add nothing to the output: the block's residual carries those tokens on). As
capacity is counted per sequence, which assignments are dropped depends on the sequence alone,
never on how the global batch is cut into micro-batches, data-parallel or expert-parallel ranks: a
finite capacity keeps the layer layout-independent, as dropless routing (c = 0) is. Evaluation and
decoding route dropless: a decode step's group is a single token, where a capacity means something
else, and cached and uncached generation must agree.

Load-balancing loss (Switch, eq. 4), computed per group and averaged over groups:

    aux = E * sum_e f_e * P_e      f_e: share of the group's k*T assignments that chose expert e (before dropping)
                                   P_e: mean router probability of expert e over the group's tokens

It is 1 for a uniform load and grows as the load concentrates. Being a mean over sequences, it is
accumulated over micro-batches and data-parallel ranks exactly as the task loss is, so it too is
layout-independent. A model adds it to its training loss through the `extra_loss()` hook (see
MoEHooks; plait's trainer asks every model for one).

Expert parallel. plait.parallel.expert calls `set_expert_parallel(group)` and turns the expert
weights into DTensors holding E/K consecutive experts on each of the K ranks of `group`; forward
then sorts the kept assignments by expert, exchanges the per-expert counts, sends every assignment's
token to its expert's rank with an uneven all_to_all_single (autograd: backward is the reverse
exchange), permutes what arrived from source-rank-major to expert-major (torchtitan's
expert_parallel does the same), runs the local experts, and sends the outputs back the same way.
The gates are applied on the token's own rank, so the router's gradient never travels.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# Stacked per expert on dim 0: what expert parallel shards (a layer has those of its kind, MoE.expert_params):
# w1/b1 -> GELU -> w2/b2, or SwiGLU (Mixtral) silu(x w1) * (x w3) -> w2 without biases.
EXPERT_PARAMS = ("w1", "b1", "w2", "b2", "w3")

# The layer's window statistics, one float64 vector: kept assignments per expert (E entries), then these TAIL.
DROPPED, ASSIGNED, AUX, FORWARDS, A2A_BYTES, A2A_S = range(6)
TAIL = 6


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _in_backward() -> bool:
    """Whether this forward is activation checkpointing's recomputation (it runs inside the autograd engine)."""
    return torch._C._current_graph_task_id() != -1


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward sends the gradients back along the same routes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, me: int, stats):
        ctx.splits, ctx.group, ctx.me, ctx.stats = (out_splits, in_splits), group, me, stats
        return _exchange(x, out_splits, in_splits, group, me, stats)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group, ctx.me, ctx.stats), None, None, None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, me: int, stats) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    t0 = time.perf_counter()
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    if stats is not None:
        # Bytes that leave this rank (its own chunk stays); host time, which is the transfer on gloo's blocking calls.
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        stats[-TAIL + A2A_BYTES] += (sum(in_splits) - in_splits[me]) * row
        stats[-TAIL + A2A_S] += time.perf_counter() - t0
    return out


def expert_major(counts: torch.Tensor) -> torch.Tensor:
    """Rows that arrived source-rank-major, counts (K sources, L local experts), reordered expert-major.

    Returns perm: arrived[perm] lists expert 0's rows from source 0, 1, ..., then expert 1's, ...
    """
    k, n_local = counts.shape
    flat = counts.reshape(-1)
    start = (flat.cumsum(0) - flat).view(k, n_local)  # where (source s, expert l)'s rows begin in the arrival order
    ct, st = counts.t().reshape(-1), start.t().reshape(-1)  # the same blocks, expert-major
    total = int(flat.sum())
    offset = ct.cumsum(0) - ct
    return torch.arange(total, device=counts.device) - offset.repeat_interleave(ct) + st.repeat_interleave(ct)


class _AuxGrad(torch.autograd.Function):
    """Identity on a layer's output whose backward also sends `weight` to the layer's load-balancing loss: the loss's
    gradient without the loss in the objective (a pipeline stage that is not the last has no loss of its own)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.weight, dtype=torch.float32, device=grad.device), None


class MoE(nn.Module):
    """Top-k routed expert MLPs (width -> hidden -> width, GELU; SwiGLU without biases when glu), optionally with a
    per-sequence capacity."""

    def __init__(self, width: int, hidden: int, experts: int, top_k: int = 1, capacity_factor: float = 0.0,
                 glu: bool = False):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k = {top_k} must be between 1 and experts = {experts}")
        if capacity_factor < 0:
            raise ValueError(f"capacity_factor = {capacity_factor} must be >= 0 (0: dropless)")
        self.experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.router = nn.Linear(width, experts, bias=False)
        self.glu = glu
        self.w1 = nn.Parameter(torch.empty(experts, width, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, width))
        if glu:
            self.w3 = nn.Parameter(torch.empty(experts, width, hidden))
            self.expert_params: tuple[str, ...] = ("w1", "w2", "w3")
        else:
            self.b1 = nn.Parameter(torch.zeros(experts, hidden))
            self.b2 = nn.Parameter(torch.zeros(experts, width))
            self.expert_params = ("w1", "b1", "w2", "b2")
        for p in (self.router.weight, self.w1, self.w2, *([self.w3] if glu else [])):
            nn.init.normal_(p, std=0.02)
        self.ep_group, self.ep_rank, self.ep_size = None, 0, 1
        self.cp_group = None  # context parallel: this rank routes its share of each sequence (set by the cp transform)
        self.aux_loss: torch.Tensor | None = None
        # pipeline stages: the weight of the load-balancing loss whose gradient the output's backward injects (then
        # extra_loss adds nothing), and what was injected since `take_injected`, for the logged loss
        self.aux_grad = 0.0
        self.injected: dict = {}  # {micro-batch key: weighted loss}: a key's last forward counts (a stage's shape
        self.injected_key = None  # inference runs it once more, before or inside the first micro-batch's forward)
        self.stats: torch.Tensor | None = None  # the window's figures (see window_stats); not state, not saved

    def set_expert_parallel(self, group) -> None:
        """Route across the ranks of `group`: this rank holds experts [rank * E/K, (rank + 1) * E/K)."""
        self.ep_group, self.ep_rank, self.ep_size = group, dist.get_rank(group), dist.get_world_size(group)

    def capacity(self, tokens: int) -> int:
        """Assignments each expert takes from a group of `tokens` tokens (0: unlimited)."""
        if self.capacity_factor <= 0:
            return 0
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.experts)

    def route(self, tokens: torch.Tensor, group: int):
        """(probabilities (N, E) in float32, expert ids (N, k), gates (N, k), kept (N, k) bool or None)."""
        probs = self.router(tokens).float().softmax(-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        gates = top_p if self.top_k == 1 else top_p / top_p.sum(-1, keepdim=True)
        cap = self.capacity(group) if self.training else 0
        if not cap:
            return probs, top_i, gates, None
        n, k, e = top_i.shape[0], self.top_k, self.experts
        # Choice-major within each group: all first choices claim slots (in token order) before any second choice.
        chosen = F.one_hot(top_i, e).view(n // group, group, k, e).transpose(1, 2).reshape(n // group, k * group, e)
        slot = ((chosen.cumsum(1) - 1) * chosen).sum(-1)  # this assignment's place in its expert's queue
        keep = (slot < cap).view(n // group, k, group).transpose(1, 2).reshape(n, k)
        return probs, top_i, gates, keep

    def load_balancing_loss(self, probs: torch.Tensor, top_i: torch.Tensor, group: int) -> torch.Tensor:
        """Switch's E * sum_e f_e P_e per group of `group` tokens, averaged over the groups."""
        e = self.experts
        f = F.one_hot(top_i, e).view(-1, group * self.top_k, e).float().mean(1)  # (groups, E), each row sums to 1
        if self.cp_group is not None:  # a group is a share of a sequence: the whole sequence's f (equal shares)
            dist.all_reduce(f, group=self.cp_group)
            f /= dist.get_world_size(self.cp_group)
        p = probs.view(-1, group, e).mean(1)  # its mean over the cp ranks, as their gradients are averaged, is P_e
        return (e * (f * p).sum(-1)).mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        group = shape[-2] if x.dim() >= 3 else shape[0]
        tokens = x.reshape(-1, shape[-1])
        probs, top_i, gates, keep = self.route(tokens, group)
        self.aux_loss = self.load_balancing_loss(probs, top_i, group) if self.training else None
        if self.training and self.stats is None:
            self.stats = torch.zeros(self.experts + TAIL, dtype=torch.float64, device=x.device)
        # The all-to-all counts every byte it moves in training (a recomputation's too: it is traffic); the routing
        # figures skip activation checkpointing's recomputed forward, which would count the same tokens twice.
        stats = self.stats if self.training else None
        counting = self.training and not _in_backward()

        n, k = top_i.shape
        expert = top_i.reshape(-1)
        token = torch.arange(n, device=x.device).repeat_interleave(k)
        gate = gates.reshape(-1)
        if keep is not None:
            kept = keep.reshape(-1)
            expert, token, gate = expert[kept], token[kept], gate[kept]
        order = torch.argsort(expert, stable=True)  # expert-major; tokens in order within an expert
        token, gate = token[order], gate[order]
        counts = torch.bincount(expert, minlength=self.experts)
        y = self._experts(tokens[token], counts, stats)
        out = torch.zeros(n, shape[-1], dtype=torch.promote_types(y.dtype, gate.dtype), device=x.device)
        out = out.index_add(0, token, y * gate[:, None])
        if counting:
            with torch.no_grad():
                stats[:self.experts] += counts
                stats[self.experts + DROPPED] += n * k - expert.numel()
                stats[self.experts + ASSIGNED] += n * k
                stats[self.experts + AUX] += self.aux_loss.detach()
                stats[self.experts + FORWARDS] += 1
        out = out.to(x.dtype).view(shape)
        if self.aux_grad and self.aux_loss is not None and torch.is_grad_enabled():
            if self.injected_key is not None and not _in_backward():  # a recomputed forward injects, logs nothing
                self.injected[self.injected_key] = self.aux_grad * self.aux_loss.detach()
            out = _AuxGrad.apply(out, self.aux_loss, self.aux_grad)
            self.aux_loss = None  # its gradient is injected: not in extra_loss too
        return out

    def take_injected(self) -> torch.Tensor | None:
        """The weighted load-balancing losses injected since the last call, summed over the micro-batches."""
        got, self.injected = list(self.injected.values()), {}
        return torch.stack(got).sum() if got else None

    def _run(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The local experts on rows sorted expert-major, counts[l] rows for local expert l."""
        if self.glu:
            w1, w2, w3 = (_local(getattr(self, name)) for name in self.expert_params)
            outs = [(F.silu(chunk @ w1[e]) * (chunk @ w3[e])) @ w2[e] for e, chunk in enumerate(rows.split(counts))]
        else:
            w1, b1, w2, b2 = (_local(getattr(self, name)) for name in self.expert_params)
            outs = [F.gelu(chunk @ w1[e] + b1[e]) @ w2[e] + b2[e] for e, chunk in enumerate(rows.split(counts))]
        return torch.cat(outs) if outs else rows

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor, stats) -> torch.Tensor:
        """Every kept assignment's expert output, in the same (expert-major) order as rows."""
        if self.ep_group is None:
            return self._run(rows, counts.tolist())
        k, me, group = self.ep_size, self.ep_rank, self.ep_group
        n_local = self.experts // k
        arriving = torch.empty_like(counts)
        dist.all_to_all_single(arriving, counts, group=group)  # counts first: what each rank will send to each expert
        arriving = arriving.view(k, n_local)  # (source rank, local expert)
        send = counts.view(k, n_local).sum(1).tolist()
        recv = arriving.sum(1).tolist()
        got = _AllToAll.apply(rows, recv, send, group, me, stats)
        perm = expert_major(arriving)
        y = self._run(got[perm], arriving.sum(0).tolist())
        back = torch.empty_like(y).index_copy(0, perm, y)  # back to the order the rows arrived in
        return _AllToAll.apply(back, send, recv, group, me, stats)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def window_stats(layers: list[MoE], reduce, ranks: int, steps: int) -> dict:
    """The MoE figures of a metrics window, over every data-parallel rank, reset for the next one.

    moe_tokens_per_expert  [[...E] per MoE layer]: kept assignments per step, the whole global batch
    moe_dropped            share of assignments dropped by the capacity (all layers)
    moe_aux_loss           the load-balancing loss, summed over layers (unweighted), mean over forwards
    moe_a2a_bytes          expert-parallel all-to-all bytes a rank sends per step (tokens, both ways, with backward)
    moe_a2a_s              seconds a rank spends in those all-to-alls per step
    """
    if not layers:
        return {}
    parts = [m.stats if m.stats is not None else torch.zeros(m.experts + TAIL, dtype=torch.float64) for m in layers]
    device = next((p.device for p in parts if p.device.type != "cpu"), parts[0].device)
    flat = reduce(torch.cat([p.to(device) for p in parts]))  # one collective for every layer
    for m in layers:
        m.stats = None
    tokens, dropped, assigned, aux, a2a, a2a_s = [], 0.0, 0.0, 0.0, 0.0, 0.0
    i = 0
    for m in layers:
        row = flat[i:i + m.experts + TAIL].tolist()
        i += m.experts + TAIL
        tail = row[m.experts:]
        tokens.append([v / steps for v in row[:m.experts]])
        dropped, assigned = dropped + tail[DROPPED], assigned + tail[ASSIGNED]
        aux += tail[AUX] / max(1.0, tail[FORWARDS])
        a2a, a2a_s = a2a + tail[A2A_BYTES], a2a_s + tail[A2A_S]
    out = {"moe_tokens_per_expert": tokens, "moe_dropped": dropped / assigned if assigned else 0.0, "moe_aux_loss": aux}
    if any(m.ep_group is not None for m in layers):
        out["moe_a2a_bytes"] = a2a / ranks / steps
        out["moe_a2a_s"] = a2a_s / ranks / steps
    return out


class MoEHooks:
    """Mixed into a model that holds MoE layers: the two hooks plait's trainer and telemetry look for.

    extra_loss()                      moe_aux_weight * the MoE layers' load-balancing losses of the last
                                      training forward (None when there is nothing to add)
    window_metrics(reduce, ranks, steps)   the figures of window_stats for metrics.jsonl
    """

    moe_aux_weight: float = 0.0

    def _moe_layers(self) -> list[MoE]:
        layers = self.__dict__.get("_moe")
        if layers is None:  # found once: the hooks run every micro-batch
            layers = self.__dict__["_moe"] = moe_layers(self)
        return layers

    def extra_loss(self) -> torch.Tensor | None:
        if not self.moe_aux_weight:
            return None
        terms = [m.aux_loss for m in self._moe_layers() if m.aux_loss is not None]
        return self.moe_aux_weight * sum(terms) if terms else None

    def window_metrics(self, reduce, ranks: int, steps: int) -> dict:
        return window_stats(self._moe_layers(), reduce, ranks, steps)
