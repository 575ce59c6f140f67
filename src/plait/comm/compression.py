"""Gradient compression as DDP communication hooks: fewer bytes on the wire per all-reduce.

    state = register_compression(ddp_model, group, Compression("topk", topk_ratio=0.01))
    ...                                   # train; after some steps:
    state.take()                          # (uncompressed all-reduce bytes, steps) since the last call

Schemes (`parallel.compression`), with the bytes each rank sends for a bucket of N fp32 gradient
entries on n ranks, against 8 N (n-1)/n for the plain ring all-reduce:

* fp16, bf16: torch's own `fp16_compress_hook` / `bf16_compress_hook` (a half-precision
  all-reduce): ratio 2.
* powersgd: torch's `PowerSGDState` / `powerSGD_hook` (Vogels, Karimireddy & Jaggi 2019,
  "PowerSGD: Practical Low-Rank Gradient Compression"), rank r, with error feedback and warm start:
  an n x m gradient travels as P (n x r) and Q (m x r), ratio nm / (r (n + m)). Biases and
  matrices too small to gain are all-reduced uncompressed; the first step is uncompressed
  (PowerSGD's start_powerSGD_iter, so that DDP's bucket rebuild sees plain gradients).
* topk: sparsification with error feedback (Stich, Cordonnier & Jaggi 2018, "Sparsified SGD with
  memory"; Lin et al. 2018, "Deep Gradient Compression"): each rank adds its residual, keeps its
  k = ceil(ratio N) largest-magnitude entries, all-gathers (value, int32 index) pairs and averages
  them; what was not sent stays in the residual. Ratio N / (n k) (an all-gather grows with n).
* int8: a compressed all-reduce (the scheme of 1-bit Adam, Tang et al. 2021, with 8 bits) with
  error feedback (Seide et al. 2014; Karimireddy et al. 2019, "Error feedback fixes SignSGD"):
  quantise each of n chunks with its own scale, all-to-all the chunks (rank j receives every
  rank's chunk j), sum and re-quantise that chunk, all-gather it. Two residuals, one for each
  quantisation. With c = ceil(N / n): ratio 8N / (n (2c + 8)), about 4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

SCHEMES = ("none", "fp16", "bf16", "powersgd", "topk", "int8")


@dataclass(frozen=True)
class Compression:
    kind: str = "none"
    powersgd_rank: int = 2
    topk_ratio: float = 0.01

    @classmethod
    def from_keys(cls, keys) -> Compression:
        """From [parallel]'s compression keys (plait.parallel.keys.DDPKeys, or the section itself)."""
        return cls(keys.compression, keys.powersgd_rank, keys.topk_ratio)


class CompressionState:
    """What a hook keeps between calls: the group, residuals (error feedback) and the uncompressed volume."""

    def __init__(self, group, spec: Compression):
        self.group, self.spec = group, spec
        self.world = dist.get_world_size(group)
        self.residuals: dict[tuple, torch.Tensor] = {}
        self.raw_bytes = 0.0  # what a plain ring all-reduce of the same buckets would have sent
        self.steps = 0
        self.powersgd = None
        if spec.kind == "powersgd":
            self.powersgd = powerSGD_hook.PowerSGDState(
                group, matrix_approximation_rank=spec.powersgd_rank, start_powerSGD_iter=2,
                use_error_feedback=True, warm_start=True, random_seed=0)

    def take(self) -> tuple[float, int]:
        """(uncompressed all-reduce bytes, steps) since the last call."""
        out = (self.raw_bytes, self.steps)
        self.raw_bytes, self.steps = 0.0, 0
        return out

    def end_step(self) -> None:
        """A step's reductions are done, where the calls cannot tell their last (FSDP2 units, in any order, once per
        micro-batch inside pipeline stages): count it, and PowerSGD's iterations with it."""
        self.steps += 1
        if self.powersgd is not None:
            self.powersgd.iter += 1

    def residual(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        """The error-feedback memory for one bucket (reset when DDP rebuilds its buckets)."""
        r = self.residuals.get(key)
        if r is None or r.shape != like.shape:
            r = self.residuals[key] = torch.zeros_like(like)
        return r


# PowerSGD issues its second all-reduce (Q) from a callback of the first; with gloo that callback runs on
# a backend thread and, with several buckets, races the next bucket's all-reduce, so that two ranks can
# issue them in different orders (a collective mismatch, then an abort). Waiting for each bucket keeps
# the order; it gives up overlapping the next bucket's backward with this bucket's communication.


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def topk_allreduce(state: CompressionState, flat: torch.Tensor, key: tuple = ("topk",)) -> torch.Tensor:
    """The mean over ranks of each rank's top-k entries of (flat + residual); updates the residual; returns the mean."""
    n, size = state.world, flat.numel()
    k = max(1, math.ceil(state.spec.topk_ratio * size))
    acc = flat + state.residual(key, flat)
    idx = acc.abs().topk(k, sorted=False).indices
    values = acc[idx]
    acc[idx] = 0.0
    state.residuals[key] = acc  # what was not sent waits for the next step
    packed = torch.cat([values.float(), idx.to(torch.int32).view(torch.float32)])
    gathered = torch.empty(n * 2 * k, dtype=torch.float32, device=flat.device)
    dist.all_gather_single(gathered, packed, group=state.group)
    gathered = gathered.view(n, 2, k)
    out = torch.zeros(size, dtype=torch.float32, device=flat.device)
    out.index_add_(0, gathered[:, 1].contiguous().view(torch.int32).reshape(-1).long(), gathered[:, 0].reshape(-1))
    return out.div_(n).to(flat.dtype)


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x to int8 with one scale per row (max |x| / 127)."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 127.0
    return torch.round(x / scale).clamp_(-127, 127).to(torch.int8), scale


def int8_allreduce(state: CompressionState, flat: torch.Tensor, key: tuple = ("int8",)) -> torch.Tensor:
    """The mean over ranks of flat, sent as int8: quantise, all-to-all, sum, re-quantise, all-gather."""
    n, size, group = state.world, flat.numel(), state.group
    c = -(-size // n)
    padded = torch.zeros(n * c, dtype=torch.float32, device=flat.device)
    padded[:size] = flat
    acc = padded + state.residual(key + ("local",), padded)
    q, scale = _quantize(acc.view(n, c))
    state.residuals[key + ("local",)] = acc - (q.float() * scale).view(-1)
    q_in, scale_in = torch.empty_like(q), torch.empty_like(scale)
    dist.all_to_all_single(q_in, q, group=group)  # row j of q_in: rank j's copy of my chunk
    dist.all_to_all_single(scale_in, scale, group=group)
    mine = (q_in.float() * scale_in).sum(0, keepdim=True) / n
    mine = mine + state.residual(key + ("chunk",), mine)
    q2, scale2 = _quantize(mine)
    state.residuals[key + ("chunk",)] = mine - q2.float() * scale2
    q_all = torch.empty(n * c, dtype=torch.int8, device=flat.device)
    scale_all = torch.empty(n, dtype=torch.float32, device=flat.device)
    dist.all_gather_single(q_all, q2.view(-1), group=group)
    dist.all_gather_single(scale_all, scale2.view(-1), group=group)
    return (q_all.view(n, c).float() * scale_all.view(n, 1)).view(-1)[:size].to(flat.dtype)


def _own_hook(fn):
    def hook(state: CompressionState, bucket) -> torch.futures.Future:
        buf = bucket.buffer()
        out = fn(state, buf, (fn.__name__, bucket.index()))
        buf.copy_(out)
        return _done(buf)

    return hook


HOOKS = {
    "fp16": lambda state, bucket: default_hooks.fp16_compress_hook(state.group, bucket),
    "bf16": lambda state, bucket: default_hooks.bf16_compress_hook(state.group, bucket),
    "powersgd": lambda state, bucket: _done(powerSGD_hook.powerSGD_hook(state.powersgd, bucket).wait()),
    "topk": _own_hook(topk_allreduce),
    "int8": _own_hook(int8_allreduce),
}


def compression_hook(state: CompressionState, bucket):  # no return annotation: DDP checks it, and ours are strings
    """DDP comm hook: tally the uncompressed volume, then run the configured scheme on the bucket."""
    buf = bucket.buffer()
    n = state.world
    state.raw_bytes += 2 * (n - 1) / n * buf.numel() * buf.element_size()
    if bucket.is_last():
        state.steps += 1
    return HOOKS[state.spec.kind](state, bucket)


class _Bucket:
    """What torch's powerSGD_hook reads of DDP's GradBucket: a flat buffer, its per-parameter views, a key for the
    error feedback and warm start, and whether it is the step's last (PowerSGD counts its iterations on those)."""

    def __init__(self, buffer: torch.Tensor, views: list[torch.Tensor], key, last: bool):
        self._buffer, self._views, self._key, self._last = buffer, views, key, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def index(self):
        return self._key

    def is_last(self) -> bool:
        return self._last


def powersgd_allreduce(state: CompressionState, flat: torch.Tensor, views: list[torch.Tensor], key: tuple,
                       last: bool = True) -> torch.Tensor:
    """The mean over ranks of flat by torch's PowerSGD hook, each of `views` (views of flat, one per parameter, in
    its shape) compressed as a matrix as in a DDP bucket; flat is overwritten with the mean and returned."""
    return powerSGD_hook.powerSGD_hook(state.powersgd, _Bucket(flat, views, key, last)).wait()


FLAT = {"topk": topk_allreduce, "int8": int8_allreduce}  # schemes that take any flat gradient, not only a bucket
BY_HAND = (*FLAT, "powersgd")  # schemes that run where no DDP bucket carries the gradient (PowerSGD given the views)


def compressed_average(state: CompressionState, flat: torch.Tensor, key: tuple = ("flat",),
                       reduce_scatter: bool = False, views: list[torch.Tensor] | None = None,
                       last: bool = True) -> torch.Tensor:
    """The mean over the group of a flat gradient by the configured scheme (topk, int8, or powersgd on `views`, the
    parameters' gradients as views of flat) where no DDP bucket carries it (ZeRO-1's flat buffer, tensor-parallel
    shards averaged over dp by hand, an FSDP2 unit's reduce-scatter); tallies the uncompressed volume: a ring
    all-reduce's, or a reduce-scatter's (half) where that is what it replaces. `last`: the step's last call (False
    where the caller's strategy calls state.end_step() instead)."""
    n = state.world
    state.raw_bytes += (1 if reduce_scatter else 2) * (n - 1) / n * flat.numel() * flat.element_size()
    if last:
        state.steps += 1
    if state.spec.kind == "powersgd":
        if views is None:
            raise ValueError("powersgd compresses each parameter's gradient as a matrix: pass its views of flat")
        return powersgd_allreduce(state, flat, views, ("powersgd", *key), last)
    return FLAT[state.spec.kind](state, flat, (state.spec.kind, *key))


def ratio_metrics(state, record: dict) -> dict:
    """For a metrics record: the uncompressed all-reduce bytes per step since the last record, and their ratio to the
    bytes the rank sent (record["comm_bytes"]). state: a CompressionState, None, or a list of them (a rank's
    pipeline stages, each with its own): their bytes add up."""
    states = [s for s in (state if isinstance(state, list) else [state]) if s is not None]
    if not states:
        return {}
    taken = [s.take() for s in states]
    raw = sum(r / max(1, steps) for r, steps in taken)
    sent = record.get("comm_bytes") or 0.0
    return {"uncompressed_bytes": raw, "compression_ratio": raw / sent if sent else None}


def register_compression(ddp_model, group, spec: Compression) -> CompressionState:
    """Register the scheme's hook on a DDP model; returns its state (for the compression ratio)."""
    if spec.kind not in HOOKS:
        raise ValueError(f"unknown compression {spec.kind!r}; choose from {', '.join(SCHEMES)}")
    state = CompressionState(group, spec)
    ddp_model.register_comm_hook(state, compression_hook)
    return state


def expected_ratio(kind: str, numel: int, world: int, shape: tuple[int, int] | None = None, rank: int = 2,
                   topk_ratio: float = 0.01) -> float:
    """The formula of each scheme's ratio (uncompressed all-reduce bytes / bytes sent) for one bucket."""
    if kind in ("fp16", "bf16"):
        return 2.0
    if kind == "powersgd":
        n, m = shape
        return n * m / (rank * (n + m))
    if kind == "topk":
        return numel / (world * max(1, math.ceil(topk_ratio * numel)))
    if kind == "int8":
        c = -(-numel // world)
        return 8 * numel / (world * (2 * c + 8))
    return 1.0
