"""A Llama-family decoder: RMSNorm, rotary positions, SwiGLU, grouped-query attention (model.name = "llama").

    model = build_llama(cfg.model, spec)   # Llama 2/3, Qwen2 (kv_bias: q/k/v biases), Mistral (sliding_window),
                                           # Mixtral (moe_experts > 0: SwiGLU experts, top-k routed, plait.models.moe)

One family of plait's decoder (plait.models.decoder, which owns the forward, the head, the layouts' hooks and
generate): this module holds its blocks, its table and how its positions reach the blocks.

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
from plait.models.decoder import Decoder, Family, KVCache, model_vocab, padded, sequence_free, window_mask
from plait.models.moe import MoE

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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """x (b, h, t, d) rotated: the two halves of each head as the real and imaginary parts (Hugging Face's layout).
    `fused` (a serving step, without autograd): each half's sine term added in place to x * cos, one new tensor
    instead of five (a 2,048-token chunk of 12 heads of 64: 0.89 -> 0.22 ms). Its sums are fused multiply-adds, so
    it differs from the formula in the last bit: training, generate and a preference run's reference pass keep the
    formula, which DPO's first step relies on (policy and reference equal bit for bit)."""
    a, b = x.chunk(2, dim=-1)
    if not fused or torch.is_grad_enabled():
        return x * cos + torch.cat([-b, a], dim=-1) * sin
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(b, sin[..., :half], value=-1)
    out[..., half:].addcmul_(a, sin[..., half:])
    return out


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
        paged = hasattr(cache, "attend")
        q, k = rotate(q, cos, sin, fused=paged), rotate(k, cos, sin, fused=paged)
        if paged:  # a paged serving step (plait.serve.engine.paged): it stores k and v and attends itself
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


class Llama(Decoder):
    """Token embedding, `layers` blocks, a final RMSNorm and a linear head (tied to the embedding or not)."""

    family = Family(attn=("q_proj", "k_proj", "v_proj", "o_proj"), mlp=("gate_proj", "up_proj", "down_proj"),
                    norms=("attn_norm", "mlp_norm"), final_norm="norm", first=("tok_emb",))

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
        self._finish(nn.RMSNorm(width, eps=norm_eps), layers)

    def forward(self, idx: torch.Tensor, cache: dict[str, KVCache] | None = None, pad: torch.Tensor | None = None,
                pos: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (batch, time) -> logits (batch, time, vocab_size), as Decoder.forward; `pos` (batch, time): the
        positions of idx where the caller knows them (a later pipeline stage under context parallel)."""
        return self.decode(idx, cache, pad, pos)

    def embed(self, idx: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
        return self.tok_emb(idx)  # the positions rotate q and k in each attention

    def block_positions(self, pos: torch.Tensor | None, x: torch.Tensor, step: bool = False) -> dict:
        """The positions for each attention's rotation; a serving step computes their cos and sin once, for every
        layer (they share head_dim and the rope)."""
        if pos is None:  # 0..t-1 past the cache: each attention caches those
            return {}
        if not step:
            return {"pos": pos}
        first = next(iter(self.blocks.values())).attn
        return {"pos": pos, "rot": first._rotation(pos, 0, pos.shape[-1], x.device, x.dtype)}

    def tp_sizes(self, tp: int) -> list[tuple[str, int, str]]:
        """Heads, kv heads, the feed-forward width and the padded vocabulary; an MoE block is refused."""
        if not len(self.blocks):
            return []
        block = next(iter(self.blocks.values()))
        rows = (self.head if self.head is not None else self.tok_emb).weight.shape[0]
        sizes = [("model.heads", block.attn.heads), ("model.kv_heads", block.attn.kv_heads)]
        if isinstance(block.mlp, SwiGLU):
            sizes.append(("model.hidden", block.mlp.gate_proj.out_features))
        elif sequence_free(block.mlp):
            raise ConfigError(f"parallel.tp = {tp}: the llama's mixture-of-experts blocks are not split by tensor "
                              "parallel; spread the experts with parallel.ep, or set parallel.tp=1")
        sizes.append(("model.vocab_multiple (the padded vocabulary)", rows))
        return [(f"{key} ({size})", size, f"set it to a multiple of {tp} or change parallel.tp") for key, size in sizes]


def build_llama(cfg, spec: DataSpec) -> Llama:
    return Llama(model_vocab(cfg, spec), cfg.context, cfg.width, cfg.heads, cfg.layers, cfg.kv_heads, cfg.hidden,
                 cfg.tie_embeddings,
                 cfg.norm_eps, cfg.rope_theta, cfg.rope_scaling, cfg.attn_bias, cfg.sliding_window, cfg.vocab_multiple or 64,
                 cfg.moe_experts, cfg.moe_top_k, cfg.moe_capacity_factor, cfg.moe_aux_weight)
