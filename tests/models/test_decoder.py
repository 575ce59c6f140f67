"""One decoder, several families: GPT and the Llama family are plait.models.decoder.Decoder, and a new family is its
block pieces and one Family table (RotaryGPT below: LayerNorm, rotary positions, a GELU MLP, biases).

Every family is held to the decoder's contracts: a KV-cached step, left padding, packed rows and a paged serving step
each give the logits of a plain forward of the same tokens; training calls each block with x alone; the layouts'
hooks (pipeline_parts, tp_plan) name the family's own modules. The numerics against the outside world are pinned
elsewhere: transformers' GPT-2 (tests/models/test_hf.py) and Llama, Qwen2, Mistral and Mixtral
(tests/models/test_llama.py), logits and greedy generation.
"""

import pytest
import torch
import torch.nn as nn

from plait.errors import ConfigError
from plait.models import gpt, llama
from plait.models.decoder import Decoder, Family
from plait.models.gpt import GPT
from plait.models.llama import Llama
from plait.parallel.split import pipeline_stage
from plait.serve.engine.paged import PagedCache

V, C = 23, 16


class RotaryBlock(nn.Module):
    """A LayerNorm block around the llama's rotary attention (with every bias) and GPT's GELU MLP."""

    def __init__(self, width: int, heads: int, context: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = llama.Attention(width, heads, heads, "all", 0, {"theta": 10000.0, "scaling": {}, "context": context})
        self.ln2 = nn.LayerNorm(width)
        self.mlp = gpt.MLP(width)

    def forward(self, x, cache=None, mask=None, pos=None):
        x = x + self.attn(self.ln1(x), cache=cache, mask=mask, pos=pos)
        return x + self.mlp(self.ln2(x))


class RotaryGPT(Decoder):
    """A new family: its blocks, its table, and the three pieces a family fills."""

    family = Family(attn=("q_proj", "k_proj", "v_proj", "o_proj"), mlp=("up", "down"), norms=("ln1", "ln2"),
                    final_norm="ln_f", first=("tok_emb",))

    def __init__(self, vocab_size: int, context: int, width: int, heads: int, layers: int):
        super().__init__()
        self.vocab_size, self.context, self.tie_embeddings = vocab_size, context, True
        self.tok_emb = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleDict({str(i): RotaryBlock(width, heads, context) for i in range(layers)})
        self._finish(nn.LayerNorm(width), layers)

    def embed(self, idx, pos):
        return self.tok_emb(idx)

    def block_positions(self, pos, x, step=False):
        return {} if pos is None else {"pos": pos}

    def tp_sizes(self, tp):
        heads = next(iter(self.blocks.values())).attn.heads
        return [(f"heads ({heads})", heads, "change it")]


FAMILIES = {
    "gpt": lambda: GPT(V, C, 16, 2, 3, tie_embeddings=False),
    "gpt-moe": lambda: GPT(V, C, 16, 2, 2, moe_experts=4, moe_top_k=2, vocab_multiple=8),
    "llama-gqa": lambda: Llama(V, C, 32, 4, 2, kv_heads=2),
    "qwen2-window": lambda: Llama(V, C, 32, 4, 2, kv_heads=1, attn_bias="qkv", sliding_window=5, tie_embeddings=True),
    "mixtral": lambda: Llama(V, C, 32, 4, 2, kv_heads=2, moe_experts=4, moe_top_k=2),
    "rotary-gpt": lambda: RotaryGPT(V, C, 16, 2, 2),
}
ATOL = 1e-5


def build(name: str) -> Decoder:
    torch.manual_seed(0)
    return FAMILIES[name]().eval()


IDS = torch.randint(0, V, (3, C), generator=torch.Generator().manual_seed(1))


def test_gpt_and_llama_share_the_decoders_code_and_differ_by_their_tables():
    for cls in (GPT, Llama):
        assert issubclass(cls, Decoder)
        for hook in ("decode", "pipeline_parts", "tied_parameters", "tp_plan", "tp_check", "generate"):
            assert getattr(cls, hook) is getattr(Decoder, hook), (cls.__name__, hook)
    assert GPT(V, C, 16, 2, 1).pipeline_parts() == {"blocks": "blocks", "first": ["tok_emb", "pos_emb", "drop"],
                                                    "last": ["ln_f", "head"]}
    assert Llama(V, C, 16, 2, 1).pipeline_parts() == {"blocks": "blocks", "first": ["tok_emb"], "last": ["norm", "head"]}
    assert RotaryGPT(V, C, 16, 2, 1).pipeline_parts() == {"blocks": "blocks", "first": ["tok_emb"],
                                                          "last": ["ln_f", "head"]}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_tp_plan_names_the_familys_own_modules(name):
    pytest.importorskip("torch.distributed.tensor.parallel")
    model = build(name)
    modules = dict(model.named_modules())
    for sp in (False, True):
        plan = model.tp_plan(sp)
        assert set(plan) <= set(modules), set(plan) - set(modules)
        attn = [k.rsplit(".", 1)[1] for k in plan if k.startswith("blocks.0.attn.")]
        assert tuple(attn) == model.family.attn
    # an MoE block stays whole on every tp rank; a dense one splits its MLP by the table's names
    mlp = [k.rsplit(".", 1)[1] for k in model.tp_plan(False) if k.startswith("blocks.1.mlp.")]
    assert tuple(mlp) == (() if name in ("gpt-moe", "mixtral") else model.family.mlp)


def test_tp_check_is_the_decoders_rule_over_the_familys_sizes():
    RotaryGPT(V, C, 16, 2, 1).tp_check(2)
    with pytest.raises(ConfigError, match=r"^heads \(2\) is not divisible by parallel.tp = 4; change it$"):
        RotaryGPT(V, C, 16, 2, 1).tp_check(4)
    with pytest.raises(ConfigError, match=r"^model.heads \(2\) is not divisible by parallel.tp = 4; set model.heads"):
        GPT(V, C, 16, 2, 1).tp_check(4)
    with pytest.raises(ConfigError, match=r"^the vocabulary \(23 rows\) is not divisible by parallel.tp = 2; pad it"):
        GPT(V, C, 16, 2, 1).tp_check(2)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_cached_step_and_left_padding_give_the_logits_of_a_plain_forward(name):
    model = build(name)
    with torch.no_grad():
        full = model(IDS)
        cache: dict = {}
        steps = [model(IDS[:, :5], cache)] + [model(IDS[:, t:t + 1], cache) for t in range(5, C)]
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=ATOL)
        assert set(cache) == set(model.blocks) and len(cache["0"]) == C
        pad = torch.tensor([0, 3, 6])
        padded = torch.stack([torch.cat([torch.zeros(p, dtype=torch.long), IDS[i, :10 - p]]) for i, p in enumerate(pad)])
        got = model(padded, pad=pad)
        for i, p in enumerate(pad.tolist()):
            torch.testing.assert_close(got[i, p:], model(IDS[i:i + 1, :10 - p])[0], rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_packed_rows_give_each_example_its_logits_alone(name):
    model = build(name)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 0]] * 3)
    with torch.no_grad():
        got = model(torch.stack([IDS, pos], 1))
        for lo, hi in ((0, 4), (4, 7), (7, 15), (15, 16)):
            torch.testing.assert_close(got[:, lo:hi], model(IDS[:, lo:hi]), rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_paged_serving_step_gives_the_logits_of_a_plain_forward(name):
    model = build(name)
    a, b = IDS[0, :7].tolist(), IDS[1, :5].tolist()
    with torch.inference_mode():
        cache = PagedCache(model, num_blocks=8, block_size=4)
        first = model(torch.tensor([a + b]), cache.step([([0, 1], 0, 7), ([2, 3], 0, 5)], rows=[6, 11]))
        nxt = [int(IDS[0, 7]), int(IDS[1, 5])]
        second = model(torch.tensor([nxt]), cache.step([([0, 1], 7, 1), ([2, 3], 5, 1)]))
        want = [model(IDS[i:i + 1, :n])[0, -1] for i, n in ((0, 7), (1, 5), (0, 8), (1, 6))]
    torch.testing.assert_close(torch.cat([first[0], second[0]]), torch.stack(want), rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_training_calls_each_block_with_x_alone_and_stages_decode_with_their_own_caches(name):
    model = build(name)
    seen = []
    for block in model.blocks.values():
        block.register_forward_pre_hook(lambda _, args, kwargs: seen.append((len(args), dict(kwargs))), with_kwargs=True)
    model.train()
    model(IDS).sum().backward()
    assert seen == [(1, {})] * len(model.blocks)  # wrappers and tensor-parallel input hooks see x alone
    model = build(name)  # a fresh one: an MoE keeps its training forward's loss, which a deep copy refuses
    stages = [pipeline_stage(model, [(0, 1), (1, len(model.blocks))], s) for s in range(2)]
    with torch.no_grad():
        caches: list[dict] = [{}, {}]
        out = [stages[1](stages[0](chunk, caches[0]), caches[1]) for chunk in (IDS[:, :6], *IDS[:, 6:].split(1, 1))]
        torch.testing.assert_close(torch.cat(out, 1), model(IDS), rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_generation_takes_the_argmax_of_a_plain_forward(name):
    model = build(name)
    with torch.no_grad():
        got = model.generate(IDS[:, :4], 8, temperature=0)
        idx = IDS[:, :4]
        for _ in range(8):
            idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], 1)
    assert got.tolist() == idx.tolist()
