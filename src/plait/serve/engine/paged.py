"""The paged KV cache's tensors and paged attention (PagedAttention, vLLM, SOSP 2023), in plain torch.

Each block of each layer holds `block_size` tokens' keys and values; the pool is one tensor per layer,
(kv_heads, num_blocks * block_size, head_dim) for keys and the same for values, so a token's slot is
`block * block_size + offset` and a sequence's cache is wherever its block table points. Heads first: a gather of
blocks is then (kv_heads, keys, head_dim) with each head's keys and dimensions contiguous, as the attention reads
them (the slots-first layout handed the attention a transposed view, which it copied: twice the decode attention).

One engine iteration is one forward over every scheduled token of every sequence, packed into a single row
(1, T): prefill chunks and decodes together, each token with its own position (`PagedStep.positions`). The
projections and MLPs run once over the T tokens; attention is each sequence's own. plait's gpt and llama
call `PagedLayer.attend(q, k, v)` in place of their attention when the cache they are given is a paged step:
it writes the new keys and values to their slots, then

- attends all the decoding sequences (one new token each) at once: their keys gathered from the pool into
  (n, kv_heads, longest, head_dim), each row masked to its own length;
- attends each prefill chunk on its own: its queries against its sequence's keys so far, causally.

On a GPU a fused kernel does the gather inside the attention (vLLM's paged_attention reads the block table
in the kernel, FlashAttention's `block_table` argument, FlexAttention's paged mask): the same slots and
block tables, without materialising the gathered keys. On a CPU with float32 pools plait has its own such
kernel for the decodes, on unless PLAIT_KERNELS=off (attention.cpp, built once per machine by
plait.serve.engine.kernels): each decode's keys and values read once where they lie, no padding (96 sequences at
330 keys: a decode step 72 -> 45 ms in-process). Without it the gather is an index_select and the paths below.
Prompt chunks take the same module's flash attention in place of SDPA's CPU one (head widths 32, 64 and 128).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.serve.engine import kernels


def kv_geometry(model: nn.Module) -> tuple[list[str], int, int]:
    """The block names, key/value heads and head width of plait's gpt or llama (what one token caches per layer)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleDict) or not len(blocks):
        raise TypeError(f"{type(model).__name__} has no blocks to cache keys and values for")
    attn: Any = next(iter(blocks.values())).attn
    return list(blocks.keys()), int(getattr(attn, "kv_heads", attn.heads)), int(attn.head_dim)


def bytes_per_block(model: nn.Module, block_size: int, tp: int = 1) -> int:
    """One block's keys and values over all layers; a tensor-parallel rank holds kv_heads / tp of the heads."""
    names, kv_heads, head_dim = kv_geometry(model)
    dtype = next(model.parameters()).dtype
    return len(names) * 2 * block_size * (kv_heads // tp) * head_dim * dtype.itemsize


class PagedCache:
    """Every layer's key and value pool; `num_blocks` blocks of `block_size` tokens each."""

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, device: torch.device | str = "cpu",
                 tp: int = 1):
        names, kv_heads, head_dim = kv_geometry(model)
        kv_heads //= tp  # a tensor-parallel rank's own heads (plait.serve.engine.tp)
        dtype = next(model.parameters()).dtype
        self.num_blocks, self.block_size = num_blocks, block_size
        self.window = int(getattr(model, "sliding_window", 0) or 0)
        self.bytes_per_block = bytes_per_block(model, block_size, tp)
        with torch.inference_mode():
            self.k = {n: torch.zeros(kv_heads, num_blocks * block_size, head_dim, dtype=dtype, device=device) for n in names}
            self.v = {n: torch.zeros_like(self.k[n]) for n in names}
        self._scratch: list[torch.Tensor | None] = [None, None]  # gathered keys and values, kept from layer to layer
        # On a CPU with float32 pools, plait's compiled decode attention (plait.serve.engine.kernels): every decode's
        # keys and values read once, where they lie; None: the plain-torch paths below
        self.decode_kernel = None
        # and its flash attention for prompt chunks (their own keys causally, earlier ones read in place), for the
        # head widths it is compiled for; None: SDPA's CPU flash attention
        self.prefill_kernel = None
        if torch.device(device).type == "cpu" and dtype == torch.float32:
            self.decode_kernel = kernels.paged_decode()  # built once per machine, loaded once per process
            if head_dim in kernels.FLASH_HEAD_DIMS:
                self.prefill_kernel = kernels.flash_attention()

    def gather(self, pool: torch.Tensor, blocks: torch.Tensor, which: int) -> torch.Tensor:
        """The blocks `blocks` of a layer's pool, (kv_heads, len(blocks) * block_size, head_dim), in the kept buffer
        `which` (0 keys, 1 values).

        The buffer is reused by every layer and every step (grown when a step needs more): a fresh tensor of this
        size each time paid its page faults, a 31 MB gather 16 ms fresh against 4 ms into a kept buffer on this CPU,
        most of a decode step's attention."""
        heads, _, d = pool.shape
        by_block = pool.view(heads, -1, self.block_size * d)
        size = heads * blocks.numel() * self.block_size * d
        if not torch.is_inference_mode_enabled():  # a kept buffer is an inference tensor: outside, a fresh one
            return by_block.index_select(1, blocks).view(heads, -1, d)
        buf = self._scratch[which]
        if buf is None or buf.numel() < size or buf.dtype != pool.dtype:
            buf = self._scratch[which] = torch.empty(size * 5 // 4, dtype=pool.dtype, device=pool.device)
        out = buf[:size].view(heads, blocks.numel(), self.block_size * d)
        if torch.get_num_threads() == 1:
            return torch.index_select(by_block, 1, blocks, out=out).view(heads, -1, d)
        # A head at a time: index_select along dim 0 of a contiguous (blocks, block) matrix copies its rows on every
        # thread, along dim 1 on one (a 2.6 MB gather on 2 threads: 110 us against 203 us, the bandwidth of a memcpy).
        for h in range(heads):
            torch.index_select(by_block[h], 0, blocks, out=out[h])
        return out.view(heads, -1, d)

    def copy(self, src: int, dst: int) -> None:
        """Block dst := block src in every layer (copy-on-write)."""
        bs = self.block_size
        for pool in (*self.k.values(), *self.v.values()):
            pool[:, dst * bs:(dst + 1) * bs] = pool[:, src * bs:(src + 1) * bs]

    def step(self, chunks: Sequence[tuple[list[int], int, int]], rows: Sequence[int] | None = None) -> PagedStep:
        """The forward's view of one iteration: chunks of (block table, first position, token count); `rows`: the
        tokens whose logits are wanted (None: every token's)."""
        return PagedStep(self, chunks, rows)


class PagedStep:
    """One iteration's positions, slots and attention groups; `layer(name)` is the cache a block is given."""

    def __init__(self, cache: PagedCache, chunks: Sequence[tuple[list[int], int, int]], rows: Sequence[int] | None = None):
        self.cache = cache
        self.chunks = list(chunks)  # what tensor-parallel ranks rebuild this step from (plait.serve.engine.tp)
        device = next(iter(cache.k.values())).device
        # The model's head runs on these tokens only: a prompt chunk needs the logits of its last token at most,
        # and the head over every prompt token was the largest product of a prefill step (T x width x vocabulary).
        self.row_list = None if rows is None else list(rows)
        self.rows = None if rows is None else torch.tensor(self.row_list, dtype=torch.long, device=device)
        bs = cache.block_size
        positions: list[int] = []
        slots: list[int] = []
        decodes: list[tuple[int, list[int], int]] = []  # (token index, block table, keys)
        # long decodes, read where they lie: (token index, runs of slots, the other slots)
        self.in_place: list[tuple[int, list[tuple[int, int]], torch.Tensor | None]] = []
        self.prefills: list[tuple[int, int, torch.Tensor, int, torch.Tensor | None]] = []  # (first, stop, blocks, keys, mask)
        self.continued: list[tuple[int, int, list[tuple[int, int]], torch.Tensor | None]] = []  # (first, stop, runs, rest)
        kernel: list[tuple[int, list[int], int]] = []  # decodes for the compiled kernel: (token index, blocks, keys)
        t = 0
        for table, start, count in chunks:
            stop = start + count
            blocks = table[:-(-stop // bs)]
            positions += range(start, stop)
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, stop)]
            if count == 1 and cache.decode_kernel is not None:
                kernel.append((t, blocks, stop))
            elif count == 1 and stop >= IN_PLACE_KEYS:
                runs, rest = _parts(blocks, bs, max(0, stop - cache.window) if cache.window else 0, stop)
                self.in_place.append((t, runs, torch.tensor(rest, device=device) if rest else None))
            elif count == 1:
                decodes.append((t, blocks, stop))
            elif start == 0 and not (cache.window and count > cache.window):
                # a prompt's first chunk attends causally to itself: SDPA's own causal path, which skips the blocks
                # above the diagonal (a boolean mask is read, and its blocks computed, whole)
                self.prefills.append((t, t + count, torch.tensor(blocks, device=device), stop, None))
            elif MERGED_CHUNKS and not cache.window and device.type == "cpu":
                # a prompt's later chunk: its earlier keys read where they lie, unmasked, its own causally
                runs, rest = _parts(blocks, bs, 0, start)
                self.continued.append((t, t + count, runs, torch.tensor(rest, device=device) if rest else None))
            else:
                q = torch.arange(start, stop)[:, None]
                k = torch.arange(stop)[None]
                mask = k <= q
                if cache.window:
                    mask &= q - k < cache.window
                self.prefills.append((t, t + count, torch.tensor(blocks, device=device), stop, mask.to(device)))
            t += count
        self.tokens = t
        self.positions = torch.tensor([positions], device=device)
        self.slots = torch.tensor(slots, device=device)
        # decodes sharing a cached prefix (the same blocks): the prefix attended once for all of them
        self.cascades: list[tuple[list[tuple[int, int]], torch.Tensor | None, tuple]] = []
        if SHARED_PREFIX_BLOCKS and not cache.window and device.type == "cpu":
            decodes = self._cascades(decodes, device)
        self.decode_groups = [self._group(g, device) for g in _by_width(decodes)]
        self.kernel = self._kernel_args(kernel) if kernel else None

    def _kernel_args(self, decodes: list[tuple[int, list[int], int]]) -> tuple[torch.Tensor, ...]:
        """(token indices, block tables padded with block 0, first and stop positions) for the compiled kernel."""
        widest = max(len(d[1]) for d in decodes)
        window = self.cache.window
        tables = torch.tensor([d[1] + [0] * (widest - len(d[1])) for d in decodes], dtype=torch.long)
        stop = torch.tensor([d[2] for d in decodes], dtype=torch.long)
        first = (stop - window).clamp_(min=0) if window else torch.zeros_like(stop)
        return torch.tensor([d[0] for d in decodes], dtype=torch.long), tables, first, stop

    def _cascades(self, decodes: list[tuple[int, list[int], int]], device) -> list[tuple[int, list[int], int]]:
        """Split off the decodes whose block tables start with the same SHARED_PREFIX_BLOCKS blocks or more (prefix
        caching hands them the same blocks): each such set is one cascade, (runs, other slots, group of suffixes),
        its shared prefix attended once for all its queries and each suffix as a decode of its own. The rest."""
        bs = self.cache.block_size
        by_start: dict[tuple[int, ...], list[tuple[int, list[int], int]]] = {}
        rest: list[tuple[int, list[int], int]] = []
        for d in decodes:
            if len(d[1]) > SHARED_PREFIX_BLOCKS:
                by_start.setdefault(tuple(d[1][:SHARED_PREFIX_BLOCKS]), []).append(d)
            else:
                rest.append(d)
        for group in by_start.values():
            tables = [d[1] for d in group]
            p, limit = 0, min(len(tb) for tb in tables) - 1  # never a sequence's last block: its own, being written
            while p < limit and all(tb[p] == tables[0][p] for tb in tables):
                p += 1
            if len(group) < 2 or p < SHARED_PREFIX_BLOCKS:
                rest += group
                continue
            runs, others = _parts(tables[0][:p], bs, 0, p * bs)
            rows, blocks, mask = self._group([(t, tb[p:], keys - p * bs) for t, tb, keys in group], device)
            additive = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
            self.cascades.append((runs, torch.tensor(others, device=device) if others else None, (rows, blocks, additive)))
        return rest

    def _group(self, decodes: list[tuple[int, list[int], int]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token indices, block ids padded to the group's widest table with block 0, key mask) of decodes."""
        bs, window = self.cache.block_size, self.cache.window
        widest = max(len(d[1]) for d in decodes)
        blocks = torch.tensor([b for d in decodes for b in d[1] + [0] * (widest - len(d[1]))], device=device)
        k = torch.arange(widest * bs)[None]
        lengths = torch.tensor([d[2] for d in decodes])[:, None]
        mask = k < lengths
        if window:
            mask &= (lengths - 1) - k < window
        rows = torch.tensor([d[0] for d in decodes], device=device, dtype=torch.long)
        return rows, blocks, mask[:, None, None].to(device)  # mask: (n, 1, 1, widest * block_size)

    def layer(self, name: str) -> PagedLayer:
        return PagedLayer(self, self.cache.k[name], self.cache.v[name])


IN_PLACE_KEYS = 1536  # a decode with at least this many keys attends its blocks where they lie (PagedLayer.attend)
IN_PLACE_RUN = 16  # consecutive blocks read in place; shorter runs are gathered with the other slots
SHARED_PREFIX_BLOCKS = 4  # decodes sharing this many cached blocks or more attend them once for all (a cascade), on a CPU
MERGED_CHUNKS = True  # a prompt's later chunk as attentions merged by log-sum-exp (PagedLayer._continued), on a CPU


def _parts(blocks: list[int], bs: int, first: int, stop: int) -> tuple[list[tuple[int, int]], list[int]]:
    """The pool slots of positions first..stop-1 of a sequence with block table `blocks`: runs of at least
    IN_PLACE_RUN consecutive blocks as (first slot, stop slot), and the slots of the rest one by one."""
    runs: list[tuple[int, int]] = []
    rest: list[int] = []
    i, n = first // bs, -(-stop // bs)
    while i < n:
        j = i + 1
        while j < n and blocks[j] == blocks[j - 1] + 1:
            j += 1
        a, b = max(i * bs, first), min(j * bs, stop)  # positions
        slot = blocks[i] * bs + (a - i * bs)
        if j - i >= IN_PLACE_RUN:
            runs.append((slot, slot + b - a))
        else:
            rest += range(slot, slot + b - a)
        i = j
    return runs, rest


def _by_width(decodes: list[tuple[int, list[int], int]], groups: int = 4) -> list[list[tuple[int, list[int], int]]]:
    """Decodes in at most `groups` groups of similar block-table width, widest first: a group is gathered and padded
    to its own widest table, so a short sequence beside a long one is not padded to the long one's length (the
    gather and the attention over padding were most of a mixed decode step). A group ends where a table is less than
    half its widest."""
    out: list[list[tuple[int, list[int], int]]] = []
    for d in sorted(decodes, key=lambda d: -len(d[1])):
        if out and (len(d[1]) * 2 >= len(out[-1][0][1]) or len(out) == groups):
            out[-1].append(d)
        else:
            out.append([d])
    return out


class PagedLayer:
    """One block's view of a paged step: `attend` writes the new keys and values, then attends each sequence."""

    def __init__(self, step: PagedStep, k_pool: torch.Tensor, v_pool: torch.Tensor):
        self.step, self.k_pool, self.v_pool = step, k_pool, v_pool

    def __len__(self) -> int:
        return 0  # positions come from the step, never from a cache length

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, heads, T, d), k and v (1, kv_heads, T, d) of the step's tokens -> attention output (1, heads, T, d)."""
        s = self.step
        self.k_pool.index_copy_(1, s.slots, k[0].to(self.k_pool.dtype))
        self.v_pool.index_copy_(1, s.slots, v[0].to(self.v_pool.dtype))
        gqa = k.shape[1] != q.shape[1]
        y = torch.empty_like(q)
        if s.kernel is not None:
            rows, tables, first, stop = s.kernel
            qd = q[0][:, rows].transpose(0, 1).contiguous()  # (n, heads, d)
            out = s.cache.decode_kernel(qd, self.k_pool, self.v_pool, tables, first, stop, s.cache.block_size,
                                        q.shape[-1] ** -0.5)
            y[0][:, rows] = out.transpose(0, 1)
        for rows, blocks, mask in s.decode_groups:
            n = len(rows)
            qd = q[0][:, rows].transpose(0, 1)[:, :, None]  # (n, heads, 1, d)
            # (kv_heads, n * keys, d) -> (n, kv_heads, keys, d): each head's keys and dimensions stay contiguous
            kd = s.cache.gather(self.k_pool, blocks, 0).view(self.k_pool.shape[0], n, -1, k.shape[-1]).transpose(0, 1)
            vd = s.cache.gather(self.v_pool, blocks, 1).view(self.v_pool.shape[0], n, -1, v.shape[-1]).transpose(0, 1)
            out = F.scaled_dot_product_attention(qd, kd.to(q.dtype), vd.to(q.dtype), attn_mask=mask, enable_gqa=gqa)
            y[0][:, rows] = out[:, :, 0].transpose(0, 1)
        if s.in_place:
            self._in_place(q, y)
        for cascade in s.cascades:
            self._cascade(q, y, *cascade)
        for first, stop, runs, rest in s.continued:
            y[0, :, first:stop] = self._continued(q[0, :, first:stop], k[0, :, first:stop], v[0, :, first:stop], runs, rest)
        for first, stop, blocks, keys, causal in s.prefills:  # causal: the chunk's mask, None for SDPA's own
            if causal is None and s.cache.prefill_kernel is not None and q.dtype == torch.float32:
                y[0, :, first:stop] = s.cache.prefill_kernel(q[0, :, first:stop], k[0, :, first:stop],
                                                             v[0, :, first:stop], True, q.shape[-1] ** -0.5)[0]
                continue
            if keys == stop - first:  # the chunk is the sequence's start: its own keys are all there is, no gather
                kp, vp = k[:, :, first:stop], v[:, :, first:stop]
            else:
                kp = s.cache.gather(self.k_pool, blocks, 0)[:, :keys][None].to(q.dtype)
                vp = s.cache.gather(self.v_pool, blocks, 1)[:, :keys][None].to(q.dtype)
            y[:, :, first:stop] = F.scaled_dot_product_attention(q[:, :, first:stop], kp, vp, attn_mask=causal,
                                                                 is_causal=causal is None, enable_gqa=gqa)
        return y

    def _in_place(self, q: torch.Tensor, y: torch.Tensor) -> None:
        """Each long decode attends its keys where they lie in the pool: a run of consecutive blocks is a view, not
        a copy (the copy was most of a decode step at 2-4 k keys: memory read twice). Keys are attended in any
        order (their positions are in their rotation already), so the softmax runs over the runs' scores and the
        gathered rest side by side. A query head's group shares its key head: the group's queries are rows of one
        (kv_heads, group, d) matrix, with no mask, so one matmul per part serves every head."""
        kv_heads, _, d = self.k_pool.shape
        scale = d ** -0.5
        for t, runs, rest in self.step.in_place:
            qh = q[0, :, t].view(kv_heads, -1, d)  # (kv_heads, group, d)
            ks = [self.k_pool[:, a:b] for a, b in runs]
            vs = [self.v_pool[:, a:b] for a, b in runs]
            if rest is not None:
                ks.append(self.k_pool.index_select(1, rest))
                vs.append(self.v_pool.index_select(1, rest))
            if len(ks) == 1:
                out = F.scaled_dot_product_attention(qh[None], ks[0][None].to(q.dtype), vs[0][None].to(q.dtype))[0]
            else:
                scores = torch.cat([torch.matmul(qh, k.to(q.dtype).transpose(1, 2)) for k in ks], dim=2)
                p = torch.softmax(scores.mul_(scale), dim=2)
                out, at = None, 0
                for v in vs:
                    part = torch.matmul(p[:, :, at:at + v.shape[1]], v.to(q.dtype))
                    out = part if out is None else out.add_(part)
                    at += v.shape[1]
            y[0, :, t] = out.reshape(-1, d)

    def _continued(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: list[tuple[int, int]],
                   rest: torch.Tensor | None) -> torch.Tensor:
        """A prompt's later chunk, q (heads, C, d) and its own k, v (kv_heads, C, d): attention over the earlier
        keys, read where they lie, and over its own keys, causally, merged by their log-sum-exps (the softmax over
        all keys, FlashAttention's merge of partial results). Against one attention over the gathered keys with a
        boolean mask: no copy of the earlier keys, no mask read in every layer, and the chunk's own keys take the
        causal kernel, which skips the blocks above the diagonal (a 3000-token prompt in chunks of 512 paid 55 %
        more attention than in one causal chunk). CPU only: the fused kernel that also returns the log-sum-exp is
        the CPU one (`_scaled_dot_product_flash_attention_for_cpu`); another device takes the masked path."""
        kernel = self.step.cache.prefill_kernel
        if kernel is not None and q.dtype == torch.float32:
            out, lse = kernel(q, k, v, True, q.shape[-1] ** -0.5)
        else:
            group = q.shape[0] // k.shape[0]
            if group > 1:
                k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            out, lse = (t[0] for t in torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[None], k[None], v[None], 0.0, True))
        outs, lses = self._unmasked(q, runs, rest)  # the earlier keys: seen by every query of the chunk
        return _merged([out, *outs], [lse, *lses])

    def _cascade(self, q: torch.Tensor, y: torch.Tensor, runs: list[tuple[int, int]], others: torch.Tensor | None,
                 suffixes: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Decodes sharing a prefix's blocks (a system prompt): every sequence's query against the shared keys in one
        call per part, read where they lie, and each sequence against its own suffix, gathered and padded as any
        decode; the two merged by their log-sum-exps (cascade attention). Against gathering the prefix once per
        sequence: n times fewer copies and reads of it."""
        rows, blocks, mask = suffixes
        kv_heads, _, d = self.k_pool.shape
        qs = q[0][:, rows]  # (heads, n, d)
        heads, n = qs.shape[0], len(rows)
        group = heads // kv_heads
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        outs, lses = self._unmasked(qs, runs, others)  # the shared prefix: every sequence's query as a row
        cache = self.step.cache
        kd = cache.gather(self.k_pool, blocks, 0).view(kv_heads, n, -1, d).transpose(0, 1)  # (n, kv_heads, keys, d)
        vd = cache.gather(self.v_pool, blocks, 1).view(kv_heads, n, -1, d).transpose(0, 1)
        qd = qs.transpose(0, 1).reshape(n, kv_heads, group, d)
        o, lp = flash(qd, kd.to(q.dtype), vd.to(q.dtype), 0.0, False, attn_mask=mask.to(q.dtype))
        outs.append(o.reshape(n, heads, d).transpose(0, 1))
        lses.append(lp.reshape(n, heads).transpose(0, 1))
        y[0][:, rows] = _merged(outs, lses)

    def _unmasked(self, q: torch.Tensor, runs: list[tuple[int, int]], others: torch.Tensor | None
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """q (heads, m, d) against the keys at `runs` (read where they lie) and at the slots `others` (gathered), with
        no mask: each part's (output (heads, m, d), log-sum-exp (heads, m)). With no mask a key head's group of query
        heads are rows of one (kv_heads, group * m, d) query, so each part is one call for every head (CPU only)."""
        kv_heads, _, d = self.k_pool.shape
        heads, m, _ = q.shape
        parts = [(self.k_pool[:, a:b], self.v_pool[:, a:b]) for a, b in runs]
        if others is not None:
            parts.append((self.k_pool.index_select(1, others), self.v_pool.index_select(1, others)))
        kernel = self.step.cache.prefill_kernel
        if kernel is not None and q.dtype == torch.float32 and self.k_pool.dtype == torch.float32:
            done = [kernel(q, kp, vp, False, d ** -0.5) for kp, vp in parts]
            return [o for o, _ in done], [lse for _, lse in done]
        qg = q.reshape(kv_heads, heads // kv_heads * m, d)[None]
        outs, lses = [], []
        for kp, vp in parts:
            o, lp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qg, kp[None].to(q.dtype), vp[None].to(q.dtype), 0.0, False)
            outs.append(o[0].reshape(heads, m, d))
            lses.append(lp[0].reshape(heads, m))
        return outs, lses


def _merged(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Attention outputs over disjoint sets of keys, (heads, m, d) each, merged into the one over all of them: each
    weighted by its share exp(lse_i) / sum_j exp(lse_j) of each query's softmax (FlashAttention's merge)."""
    weights = torch.softmax(torch.stack(lses), dim=0).to(outs[0].dtype)
    return (torch.stack(outs) * weights[..., None]).sum(0)
