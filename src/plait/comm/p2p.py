"""Tensors sent point to point with their shape and dtype: a fixed-size int64 header, then the data.

The receiver learns what is coming from the header, so a pipeline stage need not know the shape
(or dtype) the previous stage produces. The header has the same size whatever it carries, so
sender and receiver never disagree on message boundaries. A few caller-defined integers (tags:
a flag, a task id, ...) ride in it for protocols that need them, and a header may come alone.
Ranks are global ranks, as in torch.distributed.send/recv, also when a group is given.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

MAX_DIMS = 8
TAGS = 4
HEADER = TAGS + 2 + MAX_DIMS  # tags, dtype code (-1: no tensor follows), ndim, dims
# The wire codes: append only, both ends must agree.
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8, torch.uint8]


def _header(t: torch.Tensor | None, tags: Sequence[int]) -> torch.Tensor:
    if len(tags) > TAGS:
        raise ValueError(f"at most {TAGS} tags fit in a header, got {len(tags)}")
    head = [*tags, *[0] * (TAGS - len(tags))]
    if t is None:
        return torch.tensor(head + [-1, 0] + [0] * MAX_DIMS, dtype=torch.int64)
    if t.dtype not in DTYPES:
        raise TypeError(f"cannot send a {t.dtype} tensor; supported: {', '.join(str(d) for d in DTYPES)}")
    if t.dim() > MAX_DIMS:
        raise ValueError(f"cannot send a tensor of {t.dim()} dimensions; at most {MAX_DIMS}")
    return torch.tensor(head + [DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (MAX_DIMS - t.dim()),
                        dtype=torch.int64, device=t.device)


def send_tensor(t: torch.Tensor | None, dst: int, group=None, *, tags: Sequence[int] = (), async_op: bool = False) -> list:
    """Send t (or, if None, the tags alone) to rank dst; with async_op, return the posted sends' works to wait on."""
    msgs = [_header(t, tags)] + ([] if t is None else [t.contiguous()])
    if not async_op:
        for m in msgs:
            dist.send(m, dst, group=group)
        return []
    # A posted send's work keeps its buffer alive until it is waited on.
    return [dist.isend(m, dst, group=group) for m in msgs]


def recv_message(src: int, device, group=None) -> tuple[list[int], torch.Tensor | None]:
    """One message from rank src: its tags and its tensor (None when the sender sent tags alone)."""
    head = torch.empty(HEADER, dtype=torch.int64, device=device)
    dist.recv(head, src, group=group)
    values = head.tolist()
    code, ndim = values[TAGS], values[TAGS + 1]
    if code < 0:
        return values[:TAGS], None
    out = torch.empty(values[TAGS + 2:TAGS + 2 + ndim], dtype=DTYPES[code], device=device)
    dist.recv(out, src, group=group)
    return values[:TAGS], out


def recv_tensor(src: int, device, dtype: torch.dtype | None = None, group=None) -> torch.Tensor:
    """A tensor from rank src, in the dtype it was sent in, or cast to `dtype` when given."""
    _, t = recv_message(src, device, group)
    if t is None:
        raise ValueError(f"rank {src} sent a header without a tensor where a tensor was expected")
    return t if dtype is None else t.to(dtype)
