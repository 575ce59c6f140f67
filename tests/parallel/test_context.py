"""Context parallel: ring attention against full attention, the zig-zag layout's balance, and layout independence.

The ring is checked in float64 against torch's SDPA with the same mask (forward and every gradient), on one
process and on 2 and 4 ranks holding zig-zag pieces; whole training runs at cp = 2 and 4 (with dp, tp and ZeRO-3)
follow the one-process trajectory under plain SGD (tests/parallel/test_equivalence.py's tolerances).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plait.comm.ring_attention import plan_blocks, ring_attention, visible
from plait.config import load_config
from plait.errors import ConfigError
from plait.parallel import check_config
from plait.parallel.context import contiguous, shard, zigzag

B, H, KV, T, D = 2, 4, 2, 16, 8


def inputs(seed: int = 0, docs: bool = False):
    """q (B, H, T, D), k and v (B, KV, T, D) in float64, and meta (2, B, T): index and document of each token."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=torch.float64) for h in (H, KV, KV))
    doc = torch.zeros(B, T, dtype=torch.long)
    if docs:  # documents of 5, 6, 5 tokens in row 0 and of 9, 7 in row 1: boundaries inside the chunks
        doc[0, 5:], doc[0, 11:], doc[1, 9:] = 1, 2, 1
    return q, k, v, torch.stack([torch.arange(T).expand(B, T), doc])


def full_attention(q, k, v, meta, causal: bool, window: int = 0):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible(meta, meta, causal, window)[:, None], enable_gqa=True)


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-kernel", "plain-torch"])
@pytest.mark.parametrize("causal,docs,window", [(True, False, 0), (True, True, 0), (True, True, 5), (False, False, 0),
                                                 (False, True, 0)])
def test_ring_on_one_rank_is_sdpa(causal, docs, window, fused, monkeypatch):
    """Both block paths: the CPU flash kernel (what a CPU run takes) and plain torch (what other devices take)."""
    import plait.comm.ring_attention as ring

    monkeypatch.setattr(ring, "_fused", lambda q: fused)
    q, k, v, meta = inputs(docs=docs)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out, ref = ring_attention(q, k, v, meta, meta, None, causal, window), full_attention(q, k, v, meta, causal, window)
    grad = torch.randn_like(out)
    got, want = torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, leaves, grad)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def ring_rank(causal: bool, docs: bool, layout: str) -> dict:
    """Pool task: this rank's pieces of the ring's output and gradients, and the full attention's same rows."""
    import torch.distributed as dist

    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, meta = inputs(docs=docs)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = full_attention(*ref_leaves, meta, causal)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    want = torch.autograd.grad(ref, ref_leaves, grad)
    keep = (zigzag if layout == "zigzag" else contiguous)(T, cp, rank)
    mine = [t[:, :, keep].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, meta[:, :, keep], meta[:, :, keep], dist.group.WORLD, causal)
    got = torch.autograd.grad(out, mine, grad[:, :, keep])
    errors = [float((out - ref[:, :, keep]).abs().max())]
    errors += [float((a - b[:, :, keep]).abs().max()) for a, b in zip(got, want)]
    return {"errors": errors}


@pytest.mark.parametrize("causal,docs,layout", [(True, False, "zigzag"), (True, True, "zigzag"), (False, False, "zigzag"),
                                                (True, False, "contiguous")])
def test_ring_on_two_ranks_is_full_attention(pool2, causal, docs, layout):
    for r in pool2.run(ring_rank, causal, docs, layout):
        assert max(r["errors"]) < 1e-12, r


def test_ring_on_four_ranks_is_full_attention(pool4):
    for r in pool4.run(ring_rank, True, True, "zigzag"):
        assert max(r["errors"]) < 1e-12, r


def work(layout, t: int, cp: int) -> list[int]:
    """Score entries each rank computes in a causal ring over sequences of t tokens (plan_blocks, every step)."""
    meta = lambda rank: torch.stack([layout(t, cp, rank)[None], torch.zeros(1, t // cp, dtype=torch.long)])
    return [sum((qs.stop - qs.start) * (ks.stop - ks.start) for src in range(cp)
                for qs, ks, _ in plan_blocks(meta(rank), meta(src), causal=True))
            for rank in range(cp)]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_gives_every_rank_the_same_attention_work(cp):
    t = 4096
    chunk = t // (2 * cp)
    balanced = work(zigzag, t, cp)
    # each rank: 2 cp + 1 chunk pairs of chunk^2 score entries (the two diagonal ones computed whole)
    assert balanced == [(2 * cp + 1) * chunk * chunk] * cp
    assert max(balanced) / min(balanced) - 1 < 0.01
    skewed = work(contiguous, t, cp)  # rank i: 4 i + 3 pairs
    assert skewed == [(4 * i + 3) * chunk * chunk for i in range(cp)]


def test_shard_keeps_every_token_once_with_its_position_and_document():
    ids = torch.arange(2 * 16).view(2, 16)
    y = ids + 100
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0]] * 2)
    for x in (ids, torch.stack([ids, pos], 1)):
        parts = [shard(x, y, 4, r) for r in range(4)]
        index = torch.cat([p[0][:, 2] for p in parts], 1)
        assert sorted(index[0].tolist()) == list(range(16))
        order = index[0].argsort()
        rows = torch.cat([p[0] for p in parts], 2)[:, :, order]
        assert torch.equal(rows[:, 0], ids) and torch.equal(torch.cat([p[1] for p in parts], 1)[:, order], y)
        if x.dim() == 3:
            assert torch.equal(rows[:, 1], pos)
            assert rows[0, 3].tolist() == [1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 4]
        else:
            assert torch.equal(rows[:, 1], torch.arange(16).expand(2, 16)) and not rows[:, 3].any()
    assert zigzag(16, 4, 1).tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize("overrides,message", [
    (("parallel.cp=2", "parallel.ep=2", "model.moe_experts=2"),
     "parallel.cp = 2 with parallel.ep = 2 is not available yet: both cut the dp axis"),
    (("parallel.cp=4", "model.context=20"),
     "model.context (20) must be divisible by 2 x parallel.cp = 8: the zig-zag layout cuts each sequence into 8 equal "
     "chunks; set model.context to a multiple of 8"),
    (("parallel.cp=2", "model.dropout=0.1"), "parallel.cp = 2: ring attention has no attention dropout; set model.dropout=0"),
    (("parallel.cp=2", "model.name='mlp'", "data.name='digits'"),
     "parallel.cp = 2 splits the sequences of a language model (model.name = 'gpt' or 'llama'), not model.name = 'mlp'"),
    (("parallel.cp=2", "parallel.sync='gossip'"),
     "it needs tp = pp = ep = cp = 1, zero = 0 and no embedding_sharding (here dp = 1, tp = 1, pp = 1, ep = 1, cp = 2"),
])
def test_bad_layouts_are_refused_with_the_fix(overrides, message):
    with pytest.raises(ConfigError) as e:
        check_config(load_config(None, ["parallel.dp=1", *overrides]))
    assert message in str(e.value)


def test_the_layout_counts_cp_ranks_as_replicas():
    layout = check_config(load_config(None, ["parallel.dp=2", "parallel.cp=2", "parallel.tp=2", "parallel.zero=3"]))
    assert layout.world_size == 8 and layout.replicas == 4 and layout.shards_gradients
    assert [layout.coords(r) for r in (0, 1, 2, 5, 7)] == [
        {"pp": 0, "dp": 0, "tp": 0, "cp": 0, "batch": 0}, {"pp": 0, "dp": 0, "tp": 1, "cp": 0, "batch": 0},
        {"pp": 0, "dp": 1, "tp": 0, "cp": 1, "batch": 0}, {"pp": 0, "dp": 2, "tp": 1, "cp": 0, "batch": 1},
        {"pp": 0, "dp": 3, "tp": 1, "cp": 1, "batch": 1}]
    assert layout.formula() == "dp(2) * cp(2) * tp(2) * pp(1)"
    with pytest.raises(ConfigError, match=r"dp\(2\) \* cp\(2\) \* tp\(2\) \* pp\(1\) = 8 processes but"):
        layout.check_world(4)


# ---- layout independence: whole runs, plain SGD, against one process (test_equivalence's helpers and tolerances)
LLAMA = ("model.name='llama'", "data.name='text'", "model.vocab_size=0", "model.layers=2", "model.heads=4",
         "model.kv_heads=2", "model.hidden=48", "model.tie_embeddings=false", "model.rope_theta=500.0",
         "train.global_batch_size=8", "train.micro_batch_size=2")
TWO = {
    "cp2": ("parallel.dp=1", "parallel.cp=2"),
    "cp2-zero3": ("parallel.dp=1", "parallel.cp=2", "parallel.zero=3"),
    "cp2-ckpt": ("parallel.dp=1", "parallel.cp=2", "train.activation_checkpointing=true"),
}
LORA = ("finetune.lora_rank=4", "finetune.lora_alpha=8")
FOUR = {
    "cp4": ("parallel.dp=1", "parallel.cp=4"),
    "pp2xcp2-1f1b": ("parallel.dp=1", "parallel.cp=2", "parallel.pp=2", "parallel.pp_schedule='1f1b'"),
    "pp2xcp2-gpipe-ckpt": ("parallel.dp=1", "parallel.cp=2", "parallel.pp=2", "parallel.pp_schedule='gpipe'",
                           "train.activation_checkpointing=true"),
    "dp2xcp2": ("parallel.dp=2", "parallel.cp=2"),
    "cp2xtp2": ("parallel.dp=1", "parallel.cp=2", "parallel.tp=2"),
}


@pytest.fixture(scope="module")
def eq():
    """test_equivalence's trajectory helpers (imported here, not at the top, so its tests are not collected twice)."""
    import importlib

    return importlib.import_module("test_equivalence")


@pytest.fixture(scope="module")
def base(tiny_text, eq):
    from helpers import TINY_GPT

    return {"gpt": (*TINY_GPT, *eq.GPT, f"data.path='{tiny_text}'", *eq.SGD),
            "llama": (*TINY_GPT, *LLAMA, f"data.path='{tiny_text}'", *eq.SGD)}


@pytest.fixture(scope="module")
def reference(base, eq, tmp_path_factory):
    cache: dict = {}

    def get(family: str, *more: str):
        if (family, *more) not in cache:
            cache[(family, *more)] = eq.trajectory(load_config(None, [*base[family], "parallel.dp=1", *more]),
                                                   tmp_path_factory.mktemp("ref") / "run")
        return cache[(family, *more)]

    return get


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("name", list(TWO))
def test_two_rank_cp_layouts_keep_the_trajectory(pool2, eq, base, reference, tmp_path, family, name):
    got = pool2.run(eq.trajectory, load_config(None, [*base[family], *TWO[name]]), tmp_path)[0]
    eq.assert_same_trajectory(reference(family), got)


@pytest.fixture(scope="module")
def documents(tiny_text, tmp_path_factory):
    """A folder of short text files (3 source lines each, 20-200 characters): most 32-token rows cross a boundary."""
    lines = [ln for f in sorted(tiny_text.iterdir()) for ln in f.read_text().splitlines() if ln.strip()][:600]
    out = tmp_path_factory.mktemp("documents")
    for i in range(0, len(lines), 3):
        (out / f"doc{i // 3:03d}.txt").write_text("\n".join(lines[i:i + 3]) + "\n")
    return out


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_text_documents_under_cp_keep_the_trajectory(pool2, eq, base, reference, tmp_path, documents, family):
    """data.pack = true on a folder of text files: each file a document (positions restart, attention stays inside);
    at cp = 2 with ZeRO-3 the same steps as one process with the same documents."""
    docs = (f"data.path='{documents}'", "data.pack=true")
    ref = reference(family, *docs)
    assert ref.loss != reference(family, docs[0]).loss  # the documents change the run
    got = pool2.run(eq.trajectory, load_config(None, [*base[family], *TWO["cp2-zero3"], *docs]), tmp_path)[0]
    eq.assert_same_trajectory(ref, got)


def test_lora_under_cp_keeps_the_trajectory(pool2, eq, base, reference, tmp_path):
    got = pool2.run(eq.trajectory, load_config(None, [*base["gpt"], *TWO["cp2"], *LORA]), tmp_path)[0]
    eq.assert_same_trajectory(reference("gpt", *LORA), got)


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("name", list(FOUR))
def test_four_rank_cp_layouts_keep_the_trajectory(pool4, eq, base, reference, tmp_path, family, name):
    got = pool4.run(eq.trajectory, load_config(None, [*base[family], *FOUR[name]]), tmp_path)[0]
    eq.assert_same_trajectory(reference(family), got)


# ---- memory: each rank saves 1/cp of the activations (plait's accounting: what autograd saves for backward)
LONG = 4096  # tokens: activations (about 4.9 kB a token here) dwarf everything else


def activation_bytes(t: int = LONG) -> int:
    """Pool task (or in-process): bytes autograd saves in one forward of a 1-block, 64-wide GPT over t tokens, on this
    rank's tokens under context parallel when in a process group."""
    import torch.distributed as dist

    from plait.models.gpt import GPT
    from plait.parallel.context import apply_cp
    from plait.train.loss import lm_loss
    from plait.train.memory import ActivationMeter

    g = torch.Generator().manual_seed(0)
    model = GPT(64, t, 64, 2, 1)
    x, y = torch.randint(0, 64, (1, t), generator=g), torch.randint(0, 64, (1, t), generator=g)
    if dist.is_initialized():
        apply_cp(model, dist.group.WORLD)
        x, y = shard(x, y, dist.get_world_size(), dist.get_rank())
    meter = ActivationMeter(model)
    with meter.measure():
        lm_loss(model(x), y)
    return meter.peak


def test_each_rank_saves_a_cp_th_of_the_activations(pool2, pool4):
    """Measured at cp = 1 (SDPA): 20,152,324 bytes, 4,920 a token. At cp = 2 and 4 each rank saves (that + 16 bytes a
    token) / cp: the ring saves what SDPA does (q, k, v, the output, the log-sum-exp) and the inputs carry two more
    int64 rows (each token's index and document) beside the ids and positions. Within 4 bytes (the scalar loss)."""
    whole = activation_bytes()
    for pool, cp in ((pool2, 2), (pool4, 4)):
        per_rank = pool.run(activation_bytes)
        assert len(set(per_rank)) == 1  # the same on every rank
        assert abs(per_rank[0] * cp - (whole + 16 * LONG)) <= 4 * cp, (cp, per_rank[0], whole)


# ---- document masks: a packed row at cp = 2 gives the logits its documents give one by one
DOCS = (10, 13, 9)  # tokens of each document packed into one row of 32


def packed_logits(family: str) -> torch.Tensor | None:
    """Pool task: the logits (1, 32, vocab) of one packed row at cp = 2, gathered on rank 0 (None elsewhere)."""
    import torch.distributed as dist

    from plait.parallel.context import apply_cp

    model = tiny_lm(family)
    ids = torch.randint(0, 64, (1, sum(DOCS)), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]
    apply_cp(model, dist.group.WORLD)
    cp, rank = dist.get_world_size(), dist.get_rank()
    x, _ = shard(torch.stack([ids, pos], 1), ids, cp, rank)
    with torch.no_grad():
        logits = model(x)
    pieces = [torch.empty_like(logits) for _ in range(cp)]
    dist.all_gather(pieces, logits)
    if rank:
        return None
    order = torch.cat([zigzag(sum(DOCS), cp, r) for r in range(cp)]).argsort()
    return torch.cat(pieces, 1)[:, order]


def tiny_lm(family: str):
    from plait.models.gpt import GPT
    from plait.models.llama import Llama

    torch.manual_seed(0)
    if family == "gpt":
        return GPT(64, 32, 32, 2, 2)
    return Llama(64, 32, 32, 4, 2, kv_heads=2, hidden=48, vocab_multiple=1, sliding_window=6 if family == "mistral" else 0)


@pytest.mark.parametrize("family", ["gpt", "llama", "mistral"])
def test_a_packed_row_under_cp_gives_each_documents_own_logits(pool2, family):
    got = pool2.run(packed_logits, family)[0]
    model = tiny_lm(family)
    ids = torch.randint(0, 64, (1, sum(DOCS)), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]
    with torch.no_grad():
        alone = torch.cat([model(doc) for doc in ids.split(DOCS, 1)], 1)
        plain = model(torch.stack([ids, pos], 1))  # the packed row on one process: the block-masked path
    assert torch.allclose(got, alone, rtol=0, atol=1e-5), float((got - alone).abs().max())
    assert torch.allclose(plain, alone, rtol=0, atol=1e-5), float((plain - alone).abs().max())
    # and the documents do matter: attention across them (one document of 32) gives other logits
    with torch.no_grad():
        assert float((model(ids) - alone).abs().max()) > 1e-2

