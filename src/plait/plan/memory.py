"""Per-device memory of a layout, from the model's real shapes: the ZeRO paper's model states and
Korthikanti et al. (2022)'s activation accounting, itemised for plait's GPT block.

Model states (fp32 parameters and gradients, K bytes of optimizer state per parameter):
the parameters a device holds are counted exactly from the model built on the meta device,
cut into pipeline stages by the same code training uses and split by the tensor-parallel plan;
ZeRO then divides optimizer states (stage >= 1), gradients (>= 2) and parameters (3, and at
rest 2, as FSDP2 does) by dp.

Activations of one micro-batch (b sequences of s tokens, width h, a heads, element size e),
the tensors autograd saves in forward (flash attention, so no s x s scores):

    per block   e s b (16 h + 4 + a)          LN inputs 2, LN outputs 2, q k v 3, attention out 1,
                                               MLP up out 4, GELU out 4; LN statistics 4, logsumexp a
    tensor par. e s b (4 h + 12 h / t + 4 + a / t)          inside the column/row-parallel regions / t
    + seq. par. e s b (2 h + 14 h / t + (4 + a) / t)        LN inputs sharded; the gathered LN outputs not
    act. ckpt.  e s b h per block (its input), plus one block recomputed at a time in backward
    head        e s b (2 h + 2 + V) + 8 b s               ln_f in and out, log-softmax over V, token ids
    context par. every term above with s / cp tokens, + 16 b s / cp: each token's index and document (int64)

A pipeline stage holds the micro-batches in flight: m under GPipe, at most p - stage under 1F1B
(per model chunk; an interleaved rank holds v chunks). `activations_per_microbatch` is one chunk's
share of one micro-batch, what plait's accounting reports as activations_peak_bytes.

Mixture of experts (model.moe_experts = E, top-k routing, expert parallel ep): a device holds the
dense parameters and E/ep of each MoE layer's experts; ZeRO shards only the dense part (the experts
are already split over ep). An MoE block's feed-forward activations are those of its k experts per
token, each with a copy of its input and its output on the way there and back, plus the router's
probabilities: e s b (k (8 h + 2 h) + 2 E) in place of the dense MLP's e s b 8 h.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from plait.data.spec import DataSpec
from plait.models import build_model
from plait.models.moe import EXPERT_PARAMS
from plait.models.protocols import tensor_parallel_plan
from plait.parallel.layout import Layout
from plait.parallel.split import pipeline_stage, stage_bounds


@dataclass
class Shape:
    """What the cost model needs to know about a GPT."""

    layers: int
    width: int
    heads: int
    context: int
    vocab: int
    tied: bool
    params: int  # distinct parameters
    matmul_params: int  # parameters one token meets in matrix multiplies (the head counts even when tied; MoE: k experts)
    stage_params: dict  # (pp, virtual, tp, ep) -> [parameters per device of each pipeline rank]
    experts: int = 0  # experts per MoE layer (0: dense)
    top_k: int = 1
    moe_layers: int = 0
    expert_params: int = 0  # parameters of every MoE layer's experts together (the router is dense)
    tp_split: frozenset[str] = field(default_factory=frozenset)  # parameters the model's tp_plan splits over tp

    @classmethod
    def from_config(cls, model_cfg, vocab: int) -> Shape:
        spec = DataSpec(name="plan", task="lm", vocab_size=vocab, tokens_per_sample=model_cfg.context)
        with torch.device("meta"):
            model = build_model(model_cfg, spec)
        h, L = model_cfg.width, model_cfg.layers
        params = sum(p.numel() for p in model.parameters())
        matmul = 12 * h * h * L + h * model.head.out_features
        e, k = model_cfg.moe_experts, model_cfg.moe_top_k
        moe = model_cfg.layers // model_cfg.moe_every if e > 0 else 0
        # A token meets k of an MoE block's experts (8 h^2 each, the dense MLP's shape) and the router (h E).
        matmul += moe * ((k - 1) * 8 * h * h + h * e)
        experts = sum(p.numel() for n, p in model.named_parameters() if _is_expert(n))
        return cls(L, h, model_cfg.heads, model_cfg.context, model.head.out_features, model_cfg.tie_embeddings,
                   params, matmul, {"model": model}, e if moe else 0, k, moe, experts, tp_split_names(model))

    def local_expert_params(self, layout: Layout) -> int:
        """Expert parameters one device holds (E/ep of each MoE layer's)."""
        return self.expert_params // layout.ep

    def device_params(self, layout: Layout) -> list[int]:
        """Parameters each pipeline rank holds (one tensor-parallel shard), from the real module."""
        key = (layout.pp, layout.virtual_stages, layout.tp, layout.ep)
        if key not in self.stage_params:
            model = self.stage_params["model"]
            stages = layout.pp * layout.virtual_stages
            if ("parts", stages) not in self.stage_params:  # splitting copies the model: once per stage count
                bounds = stage_bounds(model, stages) if stages > 1 else [(0, self.layers)]
                parts = []
                for s in range(stages):
                    part = pipeline_stage(model, bounds, s) if stages > 1 else model
                    seen, held = set(), []
                    for name, p in part.named_parameters(remove_duplicate=False):
                        if id(p) in seen and not (stages > 1 and name == "head.weight"):
                            continue
                        seen.add(id(p))
                        held.append((name, p.numel()))
                    parts.append(held)
                self.stage_params[("parts", stages)] = parts
            per_rank = [0] * layout.pp
            for s, held in enumerate(self.stage_params[("parts", stages)]):
                for name, numel in held:
                    split = name in self.tp_split
                    per_rank[s % layout.pp] += numel // layout.ep if _is_expert(name) else numel // layout.tp if split \
                        else numel
            self.stage_params[key] = per_rank
        return self.stage_params[key]


def tp_split_names(model) -> frozenset[str]:
    """The parameters the model's own tensor-parallel plan splits: a column-parallel module's weight and bias, a
    row-parallel one's weight (its bias is added once, whole); none for a model without a plan."""
    plan = tensor_parallel_plan(model, False)
    if plan is None:
        return frozenset()
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # lazily: DTensor's styles

    names = set()
    for module, style in plan.items():
        if isinstance(style, ColwiseParallel):
            names |= {f"{module}.weight", f"{module}.bias"}
        elif isinstance(style, RowwiseParallel):
            names.add(f"{module}.weight")
    return frozenset(names)


def _is_expert(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in EXPERT_PARAMS


def activation_bytes(shape: Shape, layout: Layout, elem: int = 4) -> list[list[int]]:
    """Activations one micro-batch leaves saved in each model chunk a pipeline rank holds (bytes)."""
    # context parallel: each rank holds s / cp of every sequence's tokens (the ring saves what flash attention does)
    s, b, h, a, t = shape.context // layout.cp, layout.micro_batch, shape.width, shape.heads, layout.tp
    # MoE blocks (tp = 1 and pp = 1, as plait runs them) in place of that many dense ones: see the module docstring
    moe_extra = shape.moe_layers * elem * s * b * (shape.top_k * 10 * h + 2 * shape.experts - 8 * h) / shape.layers
    if layout.activation_checkpointing:
        block = elem * s * b * h
    elif t == 1:
        block = elem * s * b * (16 * h + 4 + a) + moe_extra
    elif not layout.sequence_parallel:
        block = elem * s * b * (4 * h + 12 * h / t + 4 + a / t)
    else:
        block = elem * s * b * (2 * h + 14 * h / t + (4 + a) / t)
    head = elem * s * b * (2 * h + 2 + shape.vocab) + 8 * b * s + (16 * b * s if layout.cp > 1 else 0)
    stages = layout.pp * layout.virtual_stages
    per_stage_layers = _layers_per_stage(shape, layout)
    out: list[list[int]] = [[] for _ in range(layout.pp)]
    for st in range(stages):
        out[st % layout.pp].append(int(per_stage_layers[st] * block + (head if st == stages - 1 else 0)))
    return out


def _layers_per_stage(shape: Shape, layout: Layout) -> list[int]:
    stages = layout.pp * layout.virtual_stages
    if stages == 1:
        return [shape.layers]
    if ("bounds", stages) not in shape.stage_params:
        shape.stage_params[("bounds", stages)] = stage_bounds(shape.stage_params["model"], stages)
    return [b - a for a, b in shape.stage_params[("bounds", stages)]]


def inflight(layout: Layout, microbatches: int, pp_rank: int) -> int:
    """Micro-batches whose activations one model chunk of a pipeline rank holds at once."""
    if layout.pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return microbatches
    return min(microbatches, layout.pp - pp_rank)


def predict_memory(shape: Shape, layout: Layout, global_batch: int, optimizer_k: int = 8, elem: int = 4) -> dict:
    """Per-device bytes of the busiest pipeline rank: params, grads, optimizer, activations, total."""
    m = global_batch // (layout.dp * layout.micro_batch)
    ranks = []
    per_rank_params = shape.device_params(layout)
    per_mb = activation_bytes(shape, layout, elem)
    for r in range(layout.pp):
        n = per_rank_params[r]
        z, d = layout.zero, layout.replicas  # ZeRO shards over the dp axis: dp * cp ranks
        experts = shape.local_expert_params(layout)  # split over ep already; ZeRO shards the dense rest
        dense = n - experts
        params = 4 * dense / (d if z >= 2 else 1) + 4 * experts
        grads = 4 * dense / (d if z >= 2 else 1) + 4 * experts
        optim = optimizer_k * dense / (d if z >= 1 else 1) + optimizer_k * experts
        act = sum(per_mb[r]) * inflight(layout, m, r)
        if layout.activation_checkpointing:  # one block's full activations while it is recomputed in backward
            act += (elem * shape.context // layout.cp * layout.micro_batch * (16 * shape.width + 4 + shape.heads)
                    / max(1, layout.tp))
        ranks.append({"params": params, "grads": grads, "optimizer": optim, "activations": act,
                      "activations_per_microbatch": max(per_mb[r]), "total": params + grads + optim + act})
    return max(ranks, key=lambda x: x["total"]) | {"per_pp_rank": ranks}
