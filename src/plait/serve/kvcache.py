"""Batched text generation for plait's GPT with a key/value cache, built from the model's own submodules.

The cached forward reuses GPT's layers (embeddings, each block's ln1/attn.q,k,v,proj/ln2/mlp,
ln_f, head) without changing plait.models.gpt. Prompts of different lengths share a batch by
left padding: each row's positions start at 0 at its first real token and a mask hides the
padding, so a row gets the tokens it would get alone (greedy: equal tokens, up to float
reduction order; sampling: each row draws from its own seeded generator).

GPT uses learned absolute positions, so once a sequence outgrows the context window every
position shifts and cached keys are stale: from there on each step recomputes the last
`context` tokens, exactly as `GPT.generate` does. The cache pays off while a prompt plus its
continuation fits the context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plait.models.gpt import GPT

Cache = list[tuple[torch.Tensor, torch.Tensor]]  # per block: keys and values (batch, heads, time, head_dim)


@dataclass
class GenRow:
    """One generation request: prompt token ids and how to sample its continuation."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0  # <= 0: greedy
    top_k: int | None = None
    seed: int = 0


def _mask(pad: torch.Tensor, past: int, t: int) -> torch.Tensor:
    """(batch, 1, t, past + t) boolean: query j of row i may see key c if pad_i <= c <= past + j."""
    keys = torch.arange(past + t)
    queries = past + torch.arange(t)
    causal = keys[None, :] <= queries[:, None]
    visible = keys[None, None, :] >= pad[:, None, None]
    mask = causal[None] & visible
    # A padding query sees no key; let it see itself so softmax stays finite (its output is unused).
    mask |= (keys[None, None, :] == queries[None, :, None]) & (queries[None, :, None] < pad[:, None, None])
    return mask[:, None]


def cached_forward(model: GPT, idx: torch.Tensor, pad: torch.Tensor, cache: Cache | None) -> tuple[torch.Tensor, Cache]:
    """Logits for new tokens idx (batch, t) after the cached ones; returns them and the extended cache."""
    past = 0 if cache is None else cache[0][0].shape[2]
    b, t = idx.shape
    pos = (past + torch.arange(t)[None, :] - pad[:, None]).clamp(min=0)
    x = model.tok_emb(idx) + model.pos_emb(pos)
    mask = _mask(pad, past, t)
    new_cache: Cache = []
    for i, block in enumerate(model.blocks.values()):
        attn = block.attn
        h = block.ln1(x)
        q, k, v = (lin(h).view(b, t, -1, attn.head_dim).transpose(1, 2) for lin in (attn.q, attn.k, attn.v))
        if cache is not None:
            k = torch.cat([cache[i][0], k], dim=2)
            v = torch.cat([cache[i][1], v], dim=2)
        new_cache.append((k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + attn.proj(y.transpose(1, 2).reshape(b, t, -1))
        x = x + block.mlp(block.ln2(x))
    return model.head(model.ln_f(x)), new_cache


def _left_pad(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    idx = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        idx[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
    return idx, torch.tensor([width - len(s) for s in seqs])


def sample_next(logits: torch.Tensor, row: GenRow, generator: torch.Generator) -> int:
    """The next token from one row's last logits: argmax when greedy, else top-k sampling at temperature."""
    logits = logits.float()
    if row.temperature <= 0:
        return int(logits.argmax())
    logits = logits / row.temperature
    if row.top_k:
        kth = torch.topk(logits, min(row.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


@torch.inference_mode()
def generate(model: GPT, rows: list[GenRow], emit: Callable[[int, int, int], None] | None = None,
             cancelled: Callable[[int], bool] | None = None, use_cache: bool = True) -> list[list[int]]:
    """New tokens for every row; emit(row, position, token) is called as each token is chosen.

    Rows that are done (or cancelled) keep a place in the batch but are no longer sampled;
    generation stops when every row is done.
    """
    ctx = model.context
    seqs = [list(r.prompt) for r in rows]
    out: list[list[int]] = [[] for _ in rows]
    gens = [torch.Generator().manual_seed(int(r.seed)) for r in rows]
    cache: Cache | None = None
    pad = torch.zeros(len(rows), dtype=torch.long)
    for _ in range(max(r.max_new_tokens for r in rows)):
        active = [i for i, r in enumerate(rows) if len(out[i]) < r.max_new_tokens and not (cancelled and cancelled(i))]
        if not active:
            break
        length = max(len(s) for s in seqs)  # rows grow in lockstep, so the padded length is shared
        if use_cache and length <= ctx:
            if cache is None:
                idx, pad = _left_pad(seqs)
                logits, cache = cached_forward(model, idx, pad, None)
            else:
                idx = torch.tensor([[s[-1]] for s in seqs], dtype=torch.long)
                logits, cache = cached_forward(model, idx, pad, cache)
        else:
            cache = None
            idx, window_pad = _left_pad([s[-ctx:] for s in seqs])
            logits, _ = cached_forward(model, idx, window_pad, None)
        last = logits[:, -1]
        for i in range(len(rows)):
            if i in active:
                tok = sample_next(last[i], rows[i], gens[i])
                out[i].append(tok)
                if emit is not None:
                    emit(i, len(out[i]) - 1, tok)
            else:
                tok = seqs[i][-1]  # a placeholder that keeps the batch rectangular
            seqs[i].append(tok)
    return out
