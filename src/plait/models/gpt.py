"""A small GPT (pre-LayerNorm decoder-only transformer) for character-level language modelling."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.data.spec import DataSpec
from plait.errors import ConfigError
from plait.models.moe import MoE, MoEHooks
from plait.models.sampling import sample


class KVCache:
    """One block's keys and values (batch, heads, time, head_dim) of the tokens seen so far, for incremental decoding."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values followed by these new ones, kept for the next step."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v


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


def attention_mask(pad: torch.Tensor, past: int, t: int) -> torch.Tensor:
    """(batch, 1, t, past + t) boolean: query j of row i may see key c if pad_i <= c <= past + j."""
    keys = torch.arange(past + t, device=pad.device)
    queries = past + torch.arange(t, device=pad.device)
    causal = keys[None, :] <= queries[:, None]
    visible = keys[None, None, :] >= pad[:, None, None]
    mask = causal[None] & visible
    # A padding query sees no key; let it see itself so softmax stays finite (its output is unused).
    mask |= (keys[None, None, :] == queries[None, :, None]) & (queries[None, :, None] < pad[:, None, None])
    return mask[:, None]


def packed_mask(pos: torch.Tensor, window: int = 0) -> torch.Tensor:
    """(batch, 1, t, t) boolean for packed rows (data.pack): causal within each example, a new one starting wherever
    its position is 0, and within `window` positions (0: unlimited). Padding after the last example is one-token
    examples (position 0), each seeing itself only."""
    doc = (pos == 0).cumsum(1)
    i = torch.arange(pos.shape[1], device=pos.device)
    mask = (i[:, None] >= i[None, :])[None] & (doc[:, :, None] == doc[:, None, :])
    if window:
        mask &= (pos[:, :, None] - pos[:, None, :]) < window
    return mask[:, None]


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


class GPT(MoEHooks, nn.Module):
    """Token + learned position embeddings, `layers` blocks, final LayerNorm, linear head.

    moe_experts > 0 makes every moe_every-th block (blocks moe_every - 1, 2 moe_every - 1, ...) a mixture of
    experts (plait.models.moe); moe_aux_weight scales their load-balancing loss in the training loss.
    activation is the dense blocks' GELU ("gelu_tanh": GPT-2's approximation), norm_eps every LayerNorm's epsilon.
    """

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
        self.ln_f = nn.LayerNorm(width, eps=norm_eps)
        self.head = nn.Linear(width, rows, bias=False)
        if tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self._init(layers)

    def _init(self, layers: int) -> None:
        for name, p in self.named_parameters():
            if name.endswith(("bias", "mlp.b1", "mlp.b2")):  # an MoE block's expert biases are stacked, (E, n)
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("proj.weight", "down.weight", "mlp.w2")):
                # GPT-2: residual projections scaled by 1/sqrt(2 * layers).
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, cache: dict[str, KVCache] | None = None,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (batch, time) -> logits (batch, time, vocab).

        A pipeline stage without the embeddings takes hidden states instead of ids, and one
        without the head returns hidden states (see plait.parallel.split).
        Incremental decoding passes `cache` ({} at first, then the same dict: one KVCache per block,
        filled here), and idx holds only the tokens after the cached ones. `pad` (batch,) is each
        row's left padding: its positions start at 0 at its first real token and the padding is masked.
        A `cache` that is a paged step (plait.serve.engine.paged.PagedStep) gives the positions of idx (1, T), the
        tokens of many sequences, and attends each to its own cached keys.
        """
        if cache is not None and not isinstance(cache, dict):  # a paged serving step: its own positions and caches
            # A later pipeline stage takes hidden states; one before the last returns every token's.
            x = self.tok_emb(idx) + self.pos_emb(cache.positions) if self.tok_emb is not None else idx
            for name, block in self.blocks.items():
                x = block(x, cache=cache.layer(name))
            if self.head is None:
                return x
            if cache.rows is not None:  # only the tokens whose logits the engine reads
                x = x[:, cache.rows]
            return self.head(self.ln_f(x))[..., :self.vocab_size]
        packed = None
        if self.tok_emb is not None and idx.dim() == 3:  # packed rows (data.pack): ids, then each example's positions
            idx, packed = idx[:, 0], idx[:, 1]
        t = idx.shape[1]
        past = len(next(iter(cache.values()))) if cache else 0
        if past + t > self.context:
            raise ValueError(f"sequence length {past + t} exceeds the model's context {self.context}")
        mask = None
        if cache is not None or pad is not None:
            pad = torch.zeros(idx.shape[0], dtype=torch.long, device=idx.device) if pad is None else pad.to(idx.device)
            mask = attention_mask(pad, past, t)
        if packed is not None:
            mask = packed_mask(packed)
        if self.tok_emb is not None:
            if packed is not None:
                pos = packed
            elif mask is None:
                pos = torch.arange(t, device=idx.device)
            else:
                pos = (past + torch.arange(t, device=idx.device)[None, :] - pad[:, None]).clamp(min=0)
            x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        else:
            x = idx
        for name, block in self.blocks.items():
            if mask is None:  # training calls block(x) alone, as wrappers and tensor-parallel input hooks expect
                x = block(x)
            else:
                x = block(x, cache=None if cache is None else cache.setdefault(name, KVCache()), mask=mask)
        if self.head is not None:
            x = self.head(self.ln_f(x))
            if x.shape[-1] != self.vocab_size:  # the padded rows' logits
                x = x[..., :self.vocab_size]
        return x

    def pipeline_parts(self) -> dict:
        """How to cut the model into pipeline stages: the repeated blocks, and what goes before and after them."""
        return {"blocks": "blocks", "first": ["tok_emb", "pos_emb", "drop"], "last": ["ln_f", "head"]}

    def tied_parameters(self) -> dict[str, str]:
        """Parameter names that alias another one: {alias: canonical}. A pipeline keeps both copies in step."""
        return {"head.weight": "tok_emb.weight"} if self.tie_embeddings else {}

    def tp_plan(self, sequence_parallel: bool) -> dict:
        """Megatron-LM's split of each block for torch.distributed.tensor.parallel.parallelize_module.

        Column-parallel q, k, v and MLP-up (each rank keeps whole heads), row-parallel attention
        output and MLP-down (one all-reduce, or a reduce-scatter with sequence parallel, each);
        the head is column-parallel over the vocabulary, and so is the token embedding when tied
        to it (a vocabulary-parallel embedding). With sequence parallel, LayerNorms work on a
        shard of the sequence and the residual stream between blocks is that shard.
        Modules a pipeline stage does not hold are left out.
        """
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

        sp = sequence_parallel
        rows_out = Shard(1) if sp else Replicate()
        plan: dict = {}
        if self.tok_emb is not None and self.tie_embeddings:
            plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        for name, block in self.blocks.items():
            b = f"blocks.{name}"
            plan.update({f"{b}.attn.q": ColwiseParallel(), f"{b}.attn.k": ColwiseParallel(),
                         f"{b}.attn.v": ColwiseParallel(), f"{b}.attn.proj": RowwiseParallel(output_layouts=rows_out)})
            if isinstance(block.mlp, MLP):  # an MoE block stays whole on every tp rank (plait.parallel.expert)
                plan.update({f"{b}.mlp.up": ColwiseParallel(), f"{b}.mlp.down": RowwiseParallel(output_layouts=rows_out)})
            if sp:
                gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
                plan.update({f"{b}.ln1": SequenceParallel(), f"{b}.ln2": SequenceParallel(),
                             f"{b}.attn": gather, f"{b}.mlp": gather})
        if sp and self.tok_emb is not None and "0" in self.blocks:
            # The embeddings' output is whole; the first block takes this rank's piece of the sequence.
            plan["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                  use_local_output=True)
        if self.head is not None:
            if sp:
                plan["ln_f"] = SequenceParallel()
            plan["head"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate())
        return plan

    def tp_check(self, tp: int) -> None:
        """Raise a ConfigError naming the key to change when the shapes do not split over tp ranks."""
        heads = next(iter(self.blocks.values())).attn.heads if len(self.blocks) else tp
        rows = self.head.out_features if self.head is not None else self.tok_emb.num_embeddings
        if heads % tp:
            raise ConfigError(f"model.heads ({heads}) is not divisible by parallel.tp = {tp}; set model.heads to a "
                              f"multiple of {tp}")
        if rows % tp:
            raise ConfigError(f"the vocabulary ({rows} rows) is not divisible by parallel.tp = {tp}; pad it with "
                              f"model.vocab_multiple = {tp} (or 64: every tp degree dividing it), or set model.vocab_size "
                              f"to a multiple of {tp}")

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample `new_tokens` continuations of idx (batch, time), one token at a time."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.context:])[:, -1, :]
            idx = torch.cat([idx, sample(logits, temperature, top_k, generator)], dim=1)
        return idx


def padded(vocab: int, multiple: int) -> int:
    """The vocabulary's rows rounded up to a multiple (so that every tp degree dividing it splits them evenly)."""
    return -(-vocab // max(1, multiple)) * max(1, multiple)


def model_vocab(cfg, spec: DataSpec) -> int:
    """model.vocab_size, or the data's; ConfigError when it is smaller than the data's."""
    vocab = cfg.vocab_size or spec.vocab_size
    if spec.vocab_size and vocab < spec.vocab_size:
        raise ConfigError(f"model.vocab_size = {cfg.vocab_size} is smaller than the data's vocabulary ({spec.vocab_size}); "
                          "set model.vocab_size=0 to take the data's size")
    return vocab


def build_gpt(cfg, spec: DataSpec) -> GPT:
    return GPT(model_vocab(cfg, spec), cfg.context, cfg.width, cfg.heads, cfg.layers, cfg.tie_embeddings, cfg.dropout,
               cfg.moe_experts, cfg.moe_top_k, cfg.moe_every, cfg.moe_capacity_factor, cfg.moe_aux_weight,
               cfg.activation, cfg.norm_eps, cfg.vocab_multiple or 1)
