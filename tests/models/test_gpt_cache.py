"""GPT's cached forward: incremental decoding (also left-padded, also cut into pipeline stages) equals a full forward."""

import torch

from plait.models.gpt import GPT
from plait.models.sampling import sample
from plait.parallel.split import pipeline_stage

V, C = 13, 16


def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(V, C, width=16, heads=2, layers=3, tie_embeddings=False).eval()


def test_incremental_decoding_gives_the_logits_of_a_full_forward():
    model = tiny()
    idx = torch.randint(0, V, (2, C), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)
        cache: dict = {}
        steps = [model(idx[:, :5], cache)] + [model(idx[:, t:t + 1], cache) for t in range(5, C)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    assert set(cache) == {"0", "1", "2"} and len(cache["0"]) == C


def test_left_padded_rows_get_the_logits_they_get_alone():
    model = tiny()
    g = torch.Generator().manual_seed(2)
    long, short = torch.randint(0, V, (1, 9), generator=g), torch.randint(0, V, (1, 5), generator=g)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 4, dtype=torch.long), short], dim=1)])
    pad = torch.tensor([0, 4])
    nxt = torch.randint(0, V, (2, 3), generator=g)
    with torch.no_grad():
        cache: dict = {}
        got = [model(batch, cache, pad)] + [model(nxt[:, t:t + 1], cache, pad) for t in range(3)]
        got = torch.cat(got, dim=1)
        for row, seq, p in ((0, long, 0), (1, short, 4)):
            alone = model(torch.cat([seq, nxt[row:row + 1]], dim=1))
            torch.testing.assert_close(got[row:row + 1, p:], alone, rtol=0, atol=1e-5)
        window = model(batch, pad=pad)  # no cache: the window recomputed, padding masked
    torch.testing.assert_close(window, got[:, :9], rtol=0, atol=1e-5)


def test_pipeline_stages_decode_with_their_own_caches():
    model = tiny()
    stages = [pipeline_stage(model, [(0, 1), (1, 3)], s) for s in range(2)]
    idx = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        caches: list[dict] = [{}, {}]
        out = []
        for chunk in (idx[:, :6], *idx[:, 6:].split(1, dim=1)):
            h = stages[0](chunk, caches[0])
            out.append(stages[1](h, caches[1]))
        torch.testing.assert_close(torch.cat(out, dim=1), model(idx), rtol=0, atol=1e-5)
    assert set(caches[0]) == {"0"} and set(caches[1]) == {"1", "2"}


def test_sampling_is_the_same_for_a_row_alone_or_in_a_batch():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    assert sample(logits, 0.0).squeeze(1).tolist() == logits.argmax(-1).tolist()
    batched = sample(logits[:1], 0.8, 5, torch.Generator().manual_seed(9))
    alone = sample(logits[0], 0.8, 5, torch.Generator().manual_seed(9))
    assert batched.shape == (1, 1) and alone.shape == (1,) and int(batched) == int(alone)
    top2 = {int(sample(logits[1], 1.0, 2, torch.Generator().manual_seed(s))) for s in range(20)}
    assert top2 <= set(torch.topk(logits[1], 2).indices.tolist())
