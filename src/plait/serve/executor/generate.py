"""Batched text generation for plait's GPT with a key/value cache (the model's own cached forward).

Prompts of different lengths share a batch by left padding: each row's positions start at 0
at its first real token and a mask hides the padding, so a row gets the tokens it would get
alone (greedy: equal tokens, up to float reduction order; sampling: each row draws from its
own seeded generator).

GPT uses learned absolute positions, so once a sequence outgrows the context window every
position shifts and cached keys are stale: from there on each step recomputes the last
`context` tokens, exactly as `GPT.generate` does. The cache pays off while a prompt plus its
continuation fits the context. plait's llama has rotary positions: its cache is exact at any length and
is never recomputed.

A row whose sampling fails (its parameters, not the model) is answered with a `RowFailed` in its
place and dropped from the batch; the other rows go on (one bad request fails alone).

On a GPU (plait.serve.model.device) the model, its cache and each step's token ids are on the device;
the last position's logits come back to the host each step and are sampled there, from each
row's CPU generator (a CPU generator cannot drive sampling of CUDA tensors, and a generator on
the GPU would draw other numbers): one seed gives one sequence of draws on every device, and the
host needs each chosen token anyway, to stream it and to feed it back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait.models.gpt import GPT, KVCache
from plait.models.llama import Llama
from plait.models.sampling import sample
from plait.serve.executor.tasks import GenRow, RowFailed

__all__ = ["GenRow", "RowFailed", "generate", "sample_row"]  # GenRow and RowFailed live in plait.serve.executor.tasks


def _left_pad(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    idx = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        idx[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
    return idx, torch.tensor([width - len(s) for s in seqs])


def sample_row(logits: torch.Tensor, row: GenRow, generator: torch.Generator) -> int:
    """The next token of one row; a non-finite distribution is an error of this row (ValueError)."""
    tok = sample(logits, row.temperature, row.top_k, generator)
    return int(tok)


@torch.inference_mode()
def generate(model: GPT | Llama, rows: list[GenRow], emit: Callable[[int, int, int], None] | None = None,
             cancelled: Callable[[int], bool] | None = None, use_cache: bool = True,
             device: torch.device | str | None = None) -> list[list[int] | RowFailed]:
    """New tokens for every row; emit(row, position, token) is called as each token is chosen.

    Rows that are done (or cancelled) keep a place in the batch but are no longer sampled;
    generation stops when every row is done. `device`: where the model is (default: where its first parameter is).
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    ctx = model.context if isinstance(model, GPT) else 1 << 62  # rotary positions: the cache never goes stale
    seqs = [list(r.prompt) for r in rows]
    out: list[list[int]] = [[] for _ in rows]
    gens = [torch.Generator().manual_seed(int(r.seed)) for r in rows]
    failed: dict[int, RowFailed] = {}
    cache: dict[str, KVCache] | None = None
    for _ in range(max(r.max_new_tokens for r in rows)):
        active = [i for i, r in enumerate(rows)
                  if len(out[i]) < r.max_new_tokens and i not in failed and not (cancelled and cancelled(i))]
        if not active:
            break
        length = max(len(s) for s in seqs)  # rows grow in lockstep, so the padded length is shared
        if use_cache and length <= ctx:
            if cache is None:
                idx, pad = _left_pad(seqs)
                pad = pad.to(device)
                cache = {}
            else:
                idx = torch.tensor([[s[-1]] for s in seqs], dtype=torch.long)
            logits = model(idx.to(device), cache, pad)
        else:
            cache = None
            idx, window_pad = _left_pad([s[-ctx:] for s in seqs])
            logits = model(idx.to(device), pad=window_pad.to(device))
        last = logits[:, -1].cpu()  # sampled on the host, with the rows' CPU generators (see the module's docstring)
        for i in range(len(rows)):
            tok = None
            if i in active:
                try:
                    tok = sample_row(last[i], rows[i], gens[i])
                except (RuntimeError, ValueError, OverflowError) as e:
                    failed[i] = RowFailed(f"{type(e).__name__}: {str(e).strip()[:200]}")
                else:
                    out[i].append(tok)
                    if emit is not None:
                        emit(i, len(out[i]) - 1, tok)
            if tok is None:
                tok = seqs[i][-1]  # a placeholder that keeps the batch rectangular
            seqs[i].append(tok)
    return [failed.get(i, o) for i, o in enumerate(out)]
