"""A Llama-family decoder: RMSNorm, rotary positions, SwiGLU, grouped-query attention (model.name = "llama").

    model = build_llama(cfg.model, spec)   # Llama 2/3, Qwen2 (kv_bias: q/k/v biases), Mistral (sliding_window),
                                           # Mixtral (moe_experts > 0: SwiGLU experts, top-k routed, plait.models.moe)

The parameter names are plait's own (tok_emb, blocks.i.attn.q_proj, blocks.i.mlp.gate_proj, norm, head);
plait.models.hf_llama maps them to and from Hugging Face checkpoints. The attention projections keep the
Hugging Face names, so LoRA targets and the Megatron patterns read the same as on a transformers model.

Rotary positions are computed in each attention from the positions it is given (default 0..t-1), so a
KV-cached step rotates its keys exactly as a full forward would; there are no learned positions and the
cache never has to be recomputed. `rope_scaling` takes Hugging Face's "linear", "dynamic" (NTK, by the
sequence length seen) and "llama3" schemes. Grouped-query attention repeats each of the kv_heads over
heads / kv_heads query heads; under tensor parallel each rank keeps heads/tp query heads and kv_heads/tp
kv heads, which are the same groups.

The vocabulary is padded to a multiple of model.vocab_multiple (so that every tp degree that divides it
splits the embedding and head evenly); the logits returned are the real vocabulary's only, so the padding
is never in a loss and never sampled.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.data.spec import DataSpec
from plait.errors import ConfigError
from plait.models.gpt import KVCache, model_vocab, packed_mask, padded
from plait.models.moe import MoE, MoEHooks
from plait.models.sampling import sample

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
ATTN_BIAS = ("none", "qkv", "all")  # Llama: none (or all with attention_bias), Qwen2: qkv


def inv_frequencies(head_dim: int, theta: float, scaling: dict, context: int, seq_len: int,
                    device=None) -> torch.Tensor:
    """Rotary inverse frequencies (head_dim / 2,) in float32 under Hugging Face's scaling rules."""
    kind = scaling.get("rope_type", "default")
    base = theta
    if kind == "dynamic":
        original = int(scaling.get("original_max_position_embeddings") or context)
        factor = float(scaling["factor"])
        if seq_len > original:  # NTK-aware: the base grows with the sequence seen
            base = theta * ((factor * seq_len / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (b, h, t, d) rotated: the two halves of each head as the real and imaginary parts (Hugging Face's layout)."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


def window_mask(pos_q: torch.Tensor, pos_k: torch.Tensor, window: int, visible: torch.Tensor | None = None):
    """(b, 1, tq, tk) boolean: causal by position, within `window` positions (0: unlimited), and `visible` keys."""
    rel = pos_q[:, :, None] - pos_k[:, None, :]
    mask = rel >= 0
    if window:
        mask &= rel < window
    if visible is not None:
        mask &= visible[:, None, :]
    # A query that sees nothing (left padding) sees itself, so softmax stays finite; its output is unused.
    diag = torch.zeros_like(mask)
    if pos_q.shape[1] <= pos_k.shape[1]:
        off = pos_k.shape[1] - pos_q.shape[1]
        idx = torch.arange(pos_q.shape[1], device=mask.device)
        diag[:, idx, idx + off] = True
    mask |= diag & ~mask.any(-1, keepdim=True)
    return mask[:, None]


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, bias: str, window: int, rope: dict):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.window, self.rope = window, rope
        self._rotations: dict = {}  # the last default positions' cos and sin (not state: never saved)
        self.q_proj = nn.Linear(width, heads * self.head_dim, bias=bias != "none")
        self.k_proj = nn.Linear(width, kv_heads * self.head_dim, bias=bias != "none")
        self.v_proj = nn.Linear(width, kv_heads * self.head_dim, bias=bias != "none")
        self.o_proj = nn.Linear(heads * self.head_dim, width, bias=bias == "all")

    # The attention itself, a seam: context parallel (plait.parallel.context) puts ring attention here.
    sdpa = staticmethod(F.scaled_dot_product_attention)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, mask: torch.Tensor | None = None,
                pos: torch.Tensor | None = None, rot: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`rot`: the positions' cos and sin when the caller computed them once for every layer (a serving step)."""
        b, t, _ = x.shape
        # -1 heads: a tensor-parallel shard holds heads/tp query heads and kv_heads/tp kv heads
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q_proj, self.k_proj, self.v_proj))
        past = len(cache) if cache is not None else 0
        cos, sin = rot if rot is not None else self._rotation(pos, past, t, x.device, q.dtype)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if hasattr(cache, "attend"):  # a paged serving step (plait.serve.engine.paged): it stores k and v and attends itself
            return self.o_proj(cache.attend(q, k, v).transpose(1, 2).reshape(b, t, -1))
        if cache is not None:
            k, v = cache.extend(k, v)
        if mask is None and self.window and t > self.window:
            p = torch.arange(t, device=x.device)[None]
            mask = window_mask(p, p, self.window)
        # enable_gqa: each of the k.shape[1] kv heads serves q.shape[1] / k.shape[1] consecutive query heads
        y = self.sdpa(q, k, v, attn_mask=mask, is_causal=mask is None and cache is None,
                      enable_gqa=k.shape[1] != q.shape[1])
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


    def _rotation(self, pos, past: int, t: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (b or 1, 1, t, head_dim) of the positions (default past .. past + t - 1)."""
        dynamic = self.rope["scaling"].get("rope_type") == "dynamic"
        key = (past, t, device, dtype)
        if pos is None and not dynamic and self._rotations.get("key") == key:  # a training step: the same t each time
            return self._rotations["value"]
        p = torch.arange(past, past + t, device=device)[None] if pos is None else pos
        seen = int(p.max()) + 1 if dynamic else 0
        inv = inv_frequencies(self.head_dim, self.rope["theta"], self.rope["scaling"], self.rope["context"], seen, device)
        angles = p.float()[:, None, :, None] * inv  # (b, 1, t, d/2)
        angles = torch.cat([angles, angles], dim=-1)
        value = angles.cos().to(dtype), angles.sin().to(dtype)
        if pos is None and not dynamic and not torch.is_inference_mode_enabled():  # inference tensors cannot train
            self._rotations = {"key": key, "value": value}
        return value


class SwiGLU(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, hidden: int, eps: float, bias: str, window: int,
                 rope: dict, moe: dict | None):
        super().__init__()
        self.attn_norm = nn.RMSNorm(width, eps=eps)
        self.attn = Attention(width, heads, kv_heads, bias, window, rope)
        self.mlp_norm = nn.RMSNorm(width, eps=eps)
        self.mlp = MoE(width, hidden, glu=True, **moe) if moe else SwiGLU(width, hidden)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, mask: torch.Tensor | None = None,
                pos: torch.Tensor | None = None, rot: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        # Keywords: a tensor-parallel input hook on attn (sequence parallel) lays out positional inputs only.
        x = x + self.attn(self.attn_norm(x), cache=cache, mask=mask, pos=pos, rot=rot)
        return x + self.mlp(self.mlp_norm(x))


class Llama(MoEHooks, nn.Module):
    """Token embedding, `layers` blocks, a final RMSNorm and a linear head (tied to the embedding or not)."""

    def __init__(self, vocab_size: int, context: int, width: int, heads: int, layers: int, kv_heads: int = 0,
                 hidden: int = 0, tie_embeddings: bool = False, norm_eps: float = 1e-6, rope_theta: float = 10000.0,
                 rope_scaling: dict | None = None, attn_bias: str = "none", sliding_window: int = 0,
                 vocab_multiple: int = 64, moe_experts: int = 0, moe_top_k: int = 2, moe_capacity_factor: float = 0.0,
                 moe_aux_weight: float = 0.0):
        super().__init__()
        kv_heads = kv_heads or heads
        hidden = hidden or 4 * width
        self.vocab_size, self.context, self.tie_embeddings = vocab_size, context, tie_embeddings
        self.sliding_window = sliding_window  # every block's; the masks built here need it
        self.moe_aux_weight = moe_aux_weight
        rope = {"theta": rope_theta, "scaling": dict(rope_scaling or {}), "context": context}
        moe = {"experts": moe_experts, "top_k": moe_top_k, "capacity_factor": moe_capacity_factor} if moe_experts else None
        rows = padded(vocab_size, vocab_multiple)
        self.tok_emb = nn.Embedding(rows, width)
        self.blocks = nn.ModuleDict({str(i): Block(width, heads, kv_heads, hidden, norm_eps, attn_bias, sliding_window,
                                                   rope, moe) for i in range(layers)})
        self.norm = nn.RMSNorm(width, eps=norm_eps)
        self.head = nn.Linear(width, rows, bias=False)
        if tie_embeddings:
            self.head.weight = self.tok_emb.weight
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "mlp.w2")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, cache: dict[str, KVCache] | None = None, pad: torch.Tensor | None = None,
                pos: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (batch, time) -> logits (batch, time, vocab_size).

        `cache` ({} at first, then the same dict) holds each block's keys and values: idx is then only the tokens
        after the cached ones. `pad` (batch,) is each row's left padding (positions start at its first real token).
        A `cache` that is a paged step (plait.serve.engine.paged.PagedStep) gives the positions of idx (1, T), the
        tokens of many sequences, and attends each to its own cached keys.
        A pipeline stage without the embedding takes hidden states, one without the head returns them.
        """
        if cache is not None and not isinstance(cache, dict):  # a paged serving step: its own positions and caches
            x = self.tok_emb(idx) if self.tok_emb is not None else idx  # a later pipeline stage: hidden states
            rot = self._rotation_once(cache.positions, x)
            for name, block in self.blocks.items():
                x = block(x, cache=cache.layer(name), pos=cache.positions, rot=rot)
            if self.head is None:  # a pipeline stage before the last: every token's hidden state goes on
                return x
            if cache.rows is not None:  # only the tokens whose logits the engine reads
                x = x[:, cache.rows]
            return self.head(self.norm(x))[..., :self.vocab_size]
        mask = None
        if self.tok_emb is not None and idx.dim() == 3:  # packed rows (data.pack): ids, then each example's positions
            idx, pos = idx[:, 0], idx[:, 1]
            mask = packed_mask(pos, self.sliding_window)
        b, t = idx.shape[:2]
        past = len(next(iter(cache.values()))) if cache else 0
        if cache is not None or pad is not None:
            pad = torch.zeros(b, dtype=torch.long, device=idx.device) if pad is None else pad.to(idx.device)
            keys = torch.arange(past + t, device=idx.device)[None] - pad[:, None]
            if pos is None:
                pos = keys[:, past:].clamp(min=0)
            mask = window_mask(keys[:, past:], keys, self.sliding_window, keys >= 0)
        x = self.tok_emb(idx) if self.tok_emb is not None else idx
        for name, block in self.blocks.items():
            if mask is None and pos is None:  # training calls block(x) alone, as wrappers and tensor-parallel hooks expect
                x = block(x)
            else:
                x = block(x, cache=None if cache is None else cache.setdefault(name, KVCache()), mask=mask, pos=pos)
        if self.head is not None:
            x = self.head(self.norm(x))
            if x.shape[-1] != self.vocab_size:
                x = x[..., :self.vocab_size]
        return x

    def _rotation_once(self, pos: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary cos and sin of `pos`, computed once for every layer (they share head_dim and the rope)."""
        first = next(iter(self.blocks.values())).attn
        return first._rotation(pos, 0, pos.shape[-1], x.device, x.dtype)

    def pipeline_parts(self) -> dict:
        return {"blocks": "blocks", "first": ["tok_emb"], "last": ["norm", "head"]}

    def tied_parameters(self) -> dict[str, str]:
        return {"head.weight": "tok_emb.weight"} if self.tie_embeddings else {}

    def tp_plan(self, sequence_parallel: bool) -> dict:
        """Megatron's split: q/k/v and gate/up column-parallel, o/down row-parallel, a vocabulary-parallel embedding
        and head; with sequence parallel the norms and the residual stream between blocks hold a piece of the sequence."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

        sp = sequence_parallel
        rows_out = Shard(1) if sp else Replicate()
        plan: dict = {}
        if self.tok_emb is not None:
            plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        for name, block in self.blocks.items():
            b = f"blocks.{name}"
            plan.update({f"{b}.attn.q_proj": ColwiseParallel(), f"{b}.attn.k_proj": ColwiseParallel(),
                         f"{b}.attn.v_proj": ColwiseParallel(), f"{b}.attn.o_proj": RowwiseParallel(output_layouts=rows_out)})
            if isinstance(block.mlp, SwiGLU):
                plan.update({f"{b}.mlp.gate_proj": ColwiseParallel(), f"{b}.mlp.up_proj": ColwiseParallel(),
                             f"{b}.mlp.down_proj": RowwiseParallel(output_layouts=rows_out)})
            if sp:
                gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
                plan.update({f"{b}.attn_norm": SequenceParallel(), f"{b}.mlp_norm": SequenceParallel(),
                             f"{b}.attn": gather, f"{b}.mlp": gather})
        if sp and self.tok_emb is not None and "0" in self.blocks:
            plan["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                  use_local_output=True)
        if self.head is not None:
            if sp:
                plan["norm"] = SequenceParallel()
            plan["head"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate())
        return plan

    def tp_check(self, tp: int) -> None:
        """ConfigError naming the key when heads, kv heads, the feed-forward width or the padded vocabulary do not split."""
        if not len(self.blocks):
            return
        block = next(iter(self.blocks.values()))
        rows = (self.head if self.head is not None else self.tok_emb).weight.shape[0]
        checks = [("model.heads", block.attn.heads), ("model.kv_heads", block.attn.kv_heads)]
        if isinstance(block.mlp, SwiGLU):
            checks.append(("model.hidden", block.mlp.gate_proj.out_features))
        elif sequence_free(block.mlp):
            raise ConfigError(f"parallel.tp = {tp}: the llama's mixture-of-experts blocks are not split by tensor "
                              "parallel; spread the experts with parallel.ep, or set parallel.tp=1")
        checks.append(("model.vocab_multiple (the padded vocabulary)", rows))
        for key, value in checks:
            if value % tp:
                raise ConfigError(f"{key} ({value}) is not divisible by parallel.tp = {tp}; set it to a multiple of {tp} "
                                  "or change parallel.tp")

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample `new_tokens` continuations of idx (batch, time) with the KV cache (exact rotary positions)."""
        cache: dict[str, KVCache] = {}
        logits = self(idx, cache=cache)[:, -1, :]
        for _ in range(new_tokens):
            nxt = sample(logits, temperature, top_k, generator)
            idx = torch.cat([idx, nxt], dim=1)
            logits = self(nxt, cache=cache)[:, -1, :]
        return idx


def sequence_free(mlp: nn.Module) -> bool:
    return isinstance(mlp, MoE)


def build_llama(cfg, spec: DataSpec) -> Llama:
    return Llama(model_vocab(cfg, spec), cfg.context, cfg.width, cfg.heads, cfg.layers, cfg.kv_heads, cfg.hidden,
                 cfg.tie_embeddings,
                 cfg.norm_eps, cfg.rope_theta, cfg.rope_scaling, cfg.attn_bias, cfg.sliding_window, cfg.vocab_multiple or 64,
                 cfg.moe_experts, cfg.moe_top_k, cfg.moe_capacity_factor, cfg.moe_aux_weight)
