"""Ring attention (Liu et al. 2023; Megatron-LM's context parallelism): attention over sequences cut across ranks.

    out = ring_attention(q, k, v, q_meta, k_meta, group, causal=True)

Every rank of `group` holds a piece of each sequence: q (batch, heads, t, head_dim) of its own tokens, k and v
(batch, kv_heads, t, head_dim) likewise (grouped-query attention: each kv head serves heads / kv_heads
consecutive query heads, as SDPA's enable_gqa), and each token's meta (2, batch, t): its index in the whole
sequence and its document id. Key j is visible to query i when both are in the same document, and (causal) j's
index <= i's, and (window > 0) i's index - j's index < window.

Forward: the K/V blocks travel round the ring (rank r sends to r + 1, receives from r - 1), one hop per step.
The receive of the next block is posted before this block's compute (isend/irecv), so the transfer overlaps the
arithmetic; each block's partial softmax is merged into the running output by its log-sum-exp (the online
softmax of FlashAttention), in float32 (or the inputs' dtype when wider). Backward: the same ring again,
FlashAttention-2's recomputation from the saved log-sum-exp; each block's dK/dV accumulator travels with the
block, picking up every rank's share, and one more hop brings it home; its exchange too overlaps the next
block's compute.

Each rank's tokens are cut into `pieces` (2: the zig-zag layout's two chunks, plait.parallel.context) and a
pair of pieces none of whose (query, key) entries is visible is skipped: that is where the causal layout's work
is saved, and `plan_blocks` (pure, no communication) says which pairs are computed, which is how the balance of
the layouts is measured.

Runs on gloo (and NCCL: the same isend/irecv, overlapped on NCCL's stream). Each block is the CPU flash-attention
kernel SDPA runs on CPU, which returns the block's log-sum-exp and whose backward takes the final output and
log-sum-exp (tiled: no block's scores whole in memory); elsewhere the blocks run in plain torch, materialising
one block's scores, where a device's own fused kernel with a log-sum-exp would go.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

TAG_KV, TAG_META, TAG_GRAD = 71, 72, 73  # distinct tags: the three kinds of message may be in flight at once


def visible(q_meta: torch.Tensor, k_meta: torch.Tensor, causal: bool, window: int = 0) -> torch.Tensor:
    """(batch, tq, tk) boolean: which keys each query may see (same document; causal; within `window`)."""
    qi, qd = q_meta[0], q_meta[1]
    ki, kd = k_meta[0], k_meta[1]
    mask = qd[:, :, None] == kd[:, None, :]
    if causal:
        mask &= ki[:, None, :] <= qi[:, :, None]
    if window:
        mask &= (qi[:, :, None] - ki[:, None, :]) < window
    return mask


def cuts(t: int, pieces: int) -> list[slice]:
    """`pieces` equal consecutive slices of t tokens (one slice when t does not divide)."""
    if pieces <= 1 or t % pieces:
        return [slice(0, t)]
    size = t // pieces
    return [slice(i * size, (i + 1) * size) for i in range(pieces)]


CAUSAL = "causal"  # a pair of pieces holding the same tokens of one document: the plain causal mask


def _pair(q_meta: torch.Tensor, k_meta: torch.Tensor, causal: bool, window: int) -> str | torch.Tensor | None:
    """How a query piece sees a key piece: None (every key), CAUSAL, a (batch, tq, tk) mask, or "none" (no key).

    Decided from the pieces' bounds where that suffices (one document a row, no window): no mask is built for the
    pairs the zig-zag layout makes, only for those that cross documents or windows."""
    qi, qd, ki, kd = q_meta[0], q_meta[1], k_meta[0], k_meta[1]
    one_doc = bool((qd == qd[:, :1]).all()) and bool((kd == qd[:, :1]).all())
    if one_doc and not window:
        if not causal or bool((ki.amax(1) <= qi.amin(1)).all()):
            return None
        if bool((ki.amin(1) > qi.amax(1)).all()):
            return "none"
        if torch.equal(qi, ki) and bool((qi[:, 1:] > qi[:, :-1]).all()):
            return CAUSAL
    mask = visible(q_meta, k_meta, causal, window)
    if not bool(mask.any()):
        return "none"
    return None if bool(mask.all()) else mask


def plan_blocks(q_meta: torch.Tensor, k_meta: torch.Tensor, causal: bool, window: int = 0,
                pieces: int = 2) -> list[tuple[slice, slice, str | torch.Tensor | None]]:
    """The (query piece, key piece, how it sees it) pairs to compute: those with a visible entry (see _pair)."""
    blocks = []
    for qs in cuts(q_meta.shape[-1], pieces):
        for ks in cuts(k_meta.shape[-1], pieces):
            how = _pair(q_meta[..., qs], k_meta[..., ks], causal, window)
            if not (isinstance(how, str) and how == "none"):
                blocks.append((qs, ks, how))
    return blocks


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """kv heads repeated to the query heads (each kv head serves consecutive query heads)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of _expand: each kv head's query heads summed back."""
    b, h, t, d = dx.shape
    return dx if h == kv_heads else dx.view(b, kv_heads, h // kv_heads, t, d).sum(2)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """What softmax statistics and sums are kept in: float32, or the inputs' dtype when wider (float64 tests)."""
    return torch.promote_types(dtype, torch.float32)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """-inf (a query that sees nothing) as 0, so exp(s - x) is 0 for its masked scores rather than NaN."""
    return x.masked_fill(torch.isneginf(x), 0.0)


def _as_mask(how, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """A pair's boolean mask (batch, tq, tk) for the plain path, or None when every key is visible."""
    if isinstance(how, str):  # CAUSAL
        return torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()[None]
    return how


# The CPU flash-attention kernel (what SDPA runs on CPU) returns its log-sum-exp, and its backward takes the final
# output and log-sum-exp: exactly a ring block's part. Tiled, so no block's scores are ever whole in memory.
_FUSED = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
          torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)


def _fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu"


def _bias(how, q: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
    """(is_causal, additive mask in q's dtype) for the fused kernel."""
    if how is None or isinstance(how, str):
        return how is not None, None
    return False, torch.zeros(how.shape, dtype=q.dtype, device=q.device).masked_fill(~how, float("-inf"))[:, None]


def _block(q, k, v, scale, how, out, lse) -> None:
    """Attend q to one key piece and merge the result into (out, lse) in place, by log-sum-exp."""
    if _fused(q):
        is_causal, bias = _bias(how, q)
        block_out, block_lse = _FUSED[0](q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale)
        block_lse = block_lse.to(lse.dtype)
        if bias is not None:  # the kernel gives a query that sees no key here lse 0, not -inf
            block_lse = block_lse.masked_fill(~how.any(-1)[:, None], float("-inf"))
        block_out = block_out.to(out.dtype)
    else:
        mask = _as_mask(how, q, k)
        s = torch.matmul(q, k.transpose(-2, -1)).to(_acc(q.dtype)) * scale
        if mask is not None:
            s = s.masked_fill(~mask[:, None], float("-inf"))
        block_lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - _finite(block_lse)[..., None])
        block_out = torch.matmul(p.to(v.dtype), v).to(out.dtype)
    new = torch.logaddexp(lse, block_lse)
    keep, add = torch.exp(lse - _finite(new)), torch.exp(block_lse - _finite(new))
    out.mul_(keep[..., None]).add_(block_out * add[..., None])
    lse.copy_(new)


def _block_backward(q, k, v, dout, out, lse, delta, scale, how, dq, dk, dv) -> None:
    """One key piece's share of dq, dk, dv (FlashAttention-2: probabilities recomputed from the final lse, and the
    final output's rowsum(dout * out) as delta)."""
    if _fused(q):
        is_causal, bias = _bias(how, q)
        gq, gk, gv = _FUSED[1](dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=bias, scale=scale)
        dq.add_(gq)
        dk.add_(gk)
        dv.add_(gv)
        return
    mask = _as_mask(how, q, k)
    acc = _acc(q.dtype)
    s = torch.matmul(q, k.transpose(-2, -1)).to(acc) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None], float("-inf"))
    p = torch.exp(s - _finite(lse)[..., None])
    dv.add_(torch.matmul(p.transpose(-2, -1), dout.to(acc)))
    dp = torch.matmul(dout.to(acc), v.to(acc).transpose(-2, -1))
    ds = p * (dp - delta[..., None]) * scale
    dq.add_(torch.matmul(ds, k.to(acc)))
    dk.add_(torch.matmul(ds.transpose(-2, -1), q.to(acc)))


class _Ring:
    """The group's ring: this rank's neighbours as global ranks, and the async exchange with them."""

    def __init__(self, group):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        if self.size > 1:
            me = dist.get_rank(group)
            self.next = dist.get_global_rank(group, (me + 1) % self.size)
            self.prev = dist.get_global_rank(group, (me - 1) % self.size)

    def shift(self, tensor: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Start sending `tensor` to the next rank and receiving the previous rank's into a new buffer."""
        buf = torch.empty_like(tensor)
        reqs = [dist.irecv(buf, self.prev, group=self.group, tag=tag),
                dist.isend(tensor, self.next, group=self.group, tag=tag)]
        return buf, reqs


def _wait(reqs: list, stats: dict | None = None) -> None:
    t0 = time.perf_counter() if stats is not None else 0.0
    for req in reqs:
        req.wait()
    if stats is not None:
        stats["wait_s"] = stats.get("wait_s", 0.0) + time.perf_counter() - t0


def _timed(stats: dict | None, key: str, t0: float) -> None:
    if stats is not None:
        stats[key] = stats.get(key, 0.0) + time.perf_counter() - t0


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_meta, k_meta, group, causal: bool, window: int, scale: float, pieces: int, stats):
        ring = _Ring(group)
        heads = q.shape[1]
        # (batch, t, heads, head_dim) underneath, as SDPA's own output: the model's transpose back to (batch, t, width)
        # is then a view, not a copy that the output projection would save beside this one
        b, h, t, d = q.shape
        out = torch.zeros((b, t, h, d), dtype=_acc(q.dtype), device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=_acc(q.dtype), device=q.device)
        kv, meta = torch.stack([k, v]).contiguous(), k_meta.contiguous()
        for step in range(ring.size):
            reqs: list = []
            if step < ring.size - 1:  # the next block is on the wire while this one is computed
                nkv, r1 = ring.shift(kv, TAG_KV)
                nmeta, r2 = ring.shift(meta, TAG_META)
                reqs = r1 + r2
            t0 = time.perf_counter()
            kk, vv = _expand(kv[0], heads), _expand(kv[1], heads)
            for qs, ks, how in plan_blocks(q_meta, meta, causal, window, pieces):
                _block(q[:, :, qs], kk[:, :, ks], vv[:, :, ks], scale, how, out[:, :, qs], lse[:, :, qs])
            _timed(stats, "compute_s", t0)
            _wait(reqs, stats)
            if reqs:
                kv, meta = nkv, nmeta
        ctx.save_for_backward(q, k, v, out, lse, q_meta, k_meta)
        ctx.ring, ctx.causal, ctx.window, ctx.scale, ctx.pieces, ctx.stats = ring, causal, window, scale, pieces, stats
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_meta, k_meta = ctx.saved_tensors
        ring, heads, kv_heads = ctx.ring, q.shape[1], k.shape[1]
        acc = out.dtype
        delta = (dout.to(acc) * out).sum(-1)
        out_q = out.to(q.dtype)  # as the fused kernel's forward would have returned it
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv, meta = torch.stack([k, v]).contiguous(), k_meta.contiguous()
        arriving = None  # (buffer, requests): the accumulated dK/dV of the block held now, from the previous rank
        for step in range(ring.size):
            reqs: list = []
            if step < ring.size - 1:
                nkv, r1 = ring.shift(kv, TAG_KV)
                nmeta, r2 = ring.shift(meta, TAG_META)
                reqs = r1 + r2
            t0 = time.perf_counter()
            kk, vv = _expand(kv[0], heads), _expand(kv[1], heads)
            dk = torch.zeros(kk.shape, dtype=acc, device=q.device)
            dv = torch.zeros(vv.shape, dtype=acc, device=q.device)
            for qs, ks, how in plan_blocks(q_meta, meta, ctx.causal, ctx.window, ctx.pieces):
                _block_backward(q[:, :, qs], kk[:, :, ks], vv[:, :, ks], dout[:, :, qs], out_q[:, :, qs], lse[:, :, qs],
                                delta[:, :, qs], ctx.scale, how, dq[:, :, qs], dk[:, :, ks], dv[:, :, ks])
            dkv = torch.stack([_fold(dk, kv_heads), _fold(dv, kv_heads)])
            _timed(ctx.stats, "compute_s", t0)
            if arriving is not None:  # what the ranks before this one added to this block
                _wait(arriving[1], ctx.stats)
                dkv += arriving[0]
            if ring.size > 1:  # on to the next rank; after the last step, that is the block's owner
                arriving = ring.shift(dkv, TAG_GRAD)
            else:
                arriving = (dkv, [])
            _wait(reqs, ctx.stats)
            if reqs:
                kv, meta = nkv, nmeta
        _wait(arriving[1], ctx.stats)
        dkv = arriving[0]
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_meta: torch.Tensor, k_meta: torch.Tensor,
                   group=None, causal: bool = True, window: int = 0, scale: float | None = None,
                   pieces: int = 2, stats: dict | None = None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v over the whole sequences of which each rank of `group` holds a piece.

    group None (or of one rank) attends to the local tokens alone: the same arithmetic, no communication.
    stats: a dict to which the seconds spent computing blocks ("compute_s") and blocked waiting for the ring's
    transfers ("wait_s", what the overlap left exposed) are added, forward and backward.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, q_meta, k_meta, group, causal, window, scale, pieces, stats)
