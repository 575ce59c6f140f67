"""plait.comm.p2p: tensors of several dtypes and shapes, and tag-only headers, arrive as sent."""

import torch
import torch.distributed as dist

from plait.testing import run_distributed

SENT = [
    torch.arange(24, dtype=torch.float32).view(2, 3, 4) / 7,
    torch.tensor([[1.5, -2.25]], dtype=torch.bfloat16),
    torch.arange(5, dtype=torch.int64) - 2,
    torch.tensor(3.0, dtype=torch.float16),
    torch.ones(1, 1, 1, 1, 1, 1, 1, 2, dtype=torch.uint8),
    torch.arange(6, dtype=torch.float64).view(3, 2).t(),  # not contiguous
]


def exchange():
    from plait.comm.p2p import recv_message, recv_tensor, send_tensor

    if dist.get_rank() == 0:
        for t in SENT:
            send_tensor(t, 1)
        works = send_tensor(SENT[0], 1, tags=(2, 7, -1), async_op=True) + send_tensor(None, 1, tags=(1,), async_op=True)
        for w in works:
            w.wait()
        send_tensor(SENT[1], 1)
        return None
    got = [recv_tensor(0, "cpu") for _ in SENT]
    tagged = recv_message(0, "cpu")
    alone = recv_message(0, "cpu")
    cast = recv_tensor(0, "cpu", dtype=torch.float32)
    return got, tagged, alone, cast


def test_round_trip_keeps_dtype_shape_and_tags():
    _, (got, tagged, alone, cast) = run_distributed(exchange, 2, timeout_s=30)
    for sent, t in zip(SENT, got):
        assert t.dtype == sent.dtype and t.shape == sent.shape and torch.equal(t, sent)
    assert tagged[0] == [2, 7, -1, 0] and torch.equal(tagged[1], SENT[0])
    assert alone == ([1, 0, 0, 0], None)
    assert cast.dtype == torch.float32 and torch.equal(cast, SENT[1].float())
