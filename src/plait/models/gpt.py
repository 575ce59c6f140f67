"""A small GPT (pre-LayerNorm decoder-only transformer) for character-level language modelling.

One family of plait's decoder (plait.models.decoder, which owns the forward, the head, the layouts' hooks and
generate): LayerNorm, learned positions, a GELU MLP, biases and dropout.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.data.spec import DataSpec
from plait.models.decoder import Decoder, Family, KVCache, model_vocab, padded
from plait.models.decoder import attention_mask as attention_mask  # the decoder's masks, imported from here too
from plait.models.decoder import packed_mask as packed_mask
from plait.models.moe import MoE


class Attention(nn.Module):
    """Causal multi-head self-attention. q, k and v are separate projections so that a
    column-parallel split gives each rank whole heads."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)
        self.dropout = dropout

    # The attention itself, a seam: context parallel (plait.parallel.context) puts ring attention here.
    sdpa = staticmethod(F.scaled_dot_product_attention)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x attends to the cached tokens and to itself; `mask` (see attention_mask) replaces the plain causal one."""
        b, t, _ = x.shape
        # -1 for the width so that a tensor-parallel shard (fewer local heads) reshapes correctly.
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        if hasattr(cache, "attend"):  # a paged serving step (plait.serve.engine.paged): it stores k and v and attends itself
            return self.proj(cache.attend(q, k, v).transpose(1, 2).reshape(b, t, -1))
        if cache is not None:
            k, v = cache.extend(k, v)
        y = self.sdpa(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))

    @property
    def head_dim(self) -> int:
        return self.proj.in_features // self.heads


ACTIVATIONS = ("gelu", "gelu_tanh")  # exact GELU, or the tanh approximation GPT-2 was trained with


class MLP(nn.Module):
    def __init__(self, width: int, activation: str = "gelu"):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.approximate = "tanh" if activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate=self.approximate))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float, moe: dict | None = None, activation: str = "gelu",
                 norm_eps: float = 1e-5):
        super().__init__()
        self.ln1 = nn.LayerNorm(width, eps=norm_eps)
        self.attn = Attention(width, heads, dropout)
        self.ln2 = nn.LayerNorm(width, eps=norm_eps)
        # An MoE block's experts are MLPs of the dense block's shape: top-1 routing has the dense block's active parameters.
        self.mlp = MoE(width, 4 * width, **moe) if moe else MLP(width, activation)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        # Keywords: a tensor-parallel input hook on attn (sequence parallel) lays out positional inputs only.
        x = x + self.drop(self.attn(self.ln1(x), cache=cache, mask=mask))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(Decoder):
    """Token + learned position embeddings, `layers` blocks, final LayerNorm, linear head (plait.models.decoder).

    moe_experts > 0 makes every moe_every-th block (blocks moe_every - 1, 2 moe_every - 1, ...) a mixture of
    experts (plait.models.moe); moe_aux_weight scales their load-balancing loss in the training loss.
    activation is the dense blocks' GELU ("gelu_tanh": GPT-2's approximation), norm_eps every LayerNorm's epsilon.
    """

    family = Family(attn=("q", "k", "v", "proj"), mlp=("up", "down"), norms=("ln1", "ln2"), final_norm="ln_f",
                    first=("tok_emb", "pos_emb", "drop"), learned_positions=True, split_untied_embedding=False)

    def __init__(self, vocab_size: int, context: int, width: int, heads: int, layers: int,
                 tie_embeddings: bool = True, dropout: float = 0.0, moe_experts: int = 0, moe_top_k: int = 1,
                 moe_every: int = 1, moe_capacity_factor: float = 0.0, moe_aux_weight: float = 0.0,
                 activation: str = "gelu", norm_eps: float = 1e-5, vocab_multiple: int = 1):
        super().__init__()
        self.context, self.vocab_size = context, vocab_size
        self.tie_embeddings = tie_embeddings
        self.moe_aux_weight = moe_aux_weight
        moe = {"experts": moe_experts, "top_k": moe_top_k, "capacity_factor": moe_capacity_factor} if moe_experts else None
        rows = padded(vocab_size, vocab_multiple)  # rows past the vocabulary: no token looks them up, no logit shows
        self.tok_emb = nn.Embedding(rows, width)
        self.pos_emb = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        # A ModuleDict keyed "0", "1", ...: a pipeline stage deletes the blocks it does not own and the
        # remaining ones keep their names (blocks.5.*), so checkpoints stay layout-free.
        self.blocks = nn.ModuleDict({str(i): Block(width, heads, dropout, moe if (i + 1) % moe_every == 0 else None,
                                                   activation, norm_eps)
                                     for i in range(layers)})
        self._finish(nn.LayerNorm(width, eps=norm_eps), layers)

    def embed(self, idx: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
        """Token plus learned position embeddings, dropped out."""
        pos = torch.arange(idx.shape[1], device=idx.device) if pos is None else pos
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))

    def block_positions(self, pos: torch.Tensor | None, x: torch.Tensor, step: bool = False) -> dict:
        return {}  # the positions are in the embedding

    def tp_sizes(self, tp: int) -> list[tuple[str, int, str]]:
        heads = next(iter(self.blocks.values())).attn.heads if len(self.blocks) else tp
        rows = self.head.out_features if self.head is not None else self.tok_emb.num_embeddings
        return [(f"model.heads ({heads})", heads, f"set model.heads to a multiple of {tp}"),
                (f"the vocabulary ({rows} rows)", rows, f"pad it with model.vocab_multiple = {tp} (or 64: every tp "
                 f"degree dividing it), or set model.vocab_size to a multiple of {tp}")]


def build_gpt(cfg, spec: DataSpec) -> GPT:
    return GPT(model_vocab(cfg, spec), cfg.context, cfg.width, cfg.heads, cfg.layers, cfg.tie_embeddings, cfg.dropout,
               cfg.moe_experts, cfg.moe_top_k, cfg.moe_every, cfg.moe_capacity_factor, cfg.moe_aux_weight,
               cfg.activation, cfg.norm_eps, cfg.vocab_multiple or 1)
