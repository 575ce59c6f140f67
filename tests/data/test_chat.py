"""data.name = "chat": prompt/completion pairs and conversations, the loss on what the model should say only.

Checked here: the chat template renders as transformers' apply_chat_template renders it; the trained tokens are
exactly the completions and assistant turns; the loss never reads a prompt position (its gradient there is 0)
and is the mean over rows of each row's mean, however the batch is split; a packed row gives each example the
logits it gets alone (plait's gpt and llama, a sliding window shorter than an example included); truncation is
counted; bad input is refused naming the line. tests/parallel/test_llama_layouts.py runs packed chat data at dp2
ZeRO-3 and tp2 against one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.config import load_config
from plait.data.chat import IGNORE, ChatTemplate, encode, pieces, rows
from plait.data.sources import build_data
from plait.data.tokenizer import CharTokenizer
from plait.errors import ConfigError, DataError
from plait.train.loss import masked_lm_loss

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TALK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "Seven."}]


def chat_examples(n: int = 40) -> list[dict]:
    """Prompt/completion pairs of varied lengths (a few longer than a 32-token context), deterministic."""
    g = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega"]
    out = []
    for i in range(n):
        k = int(torch.randint(1, 4, (1,), generator=g))
        m = int(torch.randint(1, 3 if i % 9 else 9, (1,), generator=g))
        pick = torch.randint(0, len(words), (k + m,), generator=g).tolist()
        out.append({"prompt": " ".join(words[j] for j in pick[:k]) + "?", "completion": " " + " ".join(
            words[j] for j in pick[k:]) + "."})
    return out


def write_jsonl(path: Path, examples: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A word-level tokenizer.json with the ChatML markers as special tokens, and a tokenizer_config.json with the
    chat template: what a Hugging Face model directory holds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "isolated")
    tok.decoder = decoders.Fuse()  # the spaces are tokens of their own: decode concatenates
    specials = ["[UNK]", "<|im_start|>", "<|im_end|>", "</s>"]
    corpus = [" ".join(m["content"] for m in TALK), "system user assistant \n", "a b c d e f g"]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=specials))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "</s>",
                                                         "bos_token": {"content": "<s>"}}))
    return d / "tokenizer.json"


def test_the_template_renders_as_transformers_renders_it(hf_tokenizer):
    from transformers import PreTrainedTokenizerFast

    theirs = PreTrainedTokenizerFast(tokenizer_file=str(hf_tokenizer), chat_template=CHATML)
    ours = ChatTemplate(CHATML)
    for upto, gen in ((len(TALK), False), (2, True), (4, True)):
        assert ours.render(TALK[:upto], gen) == theirs.apply_chat_template(TALK[:upto], tokenize=False,
                                                                           add_generation_prompt=gen)


def test_only_the_assistant_turns_are_trained(hf_tokenizer, tmp_path):
    parts = pieces("x", {"messages": TALK}, ChatTemplate(CHATML), "")
    assert [t for t, trained in parts if trained] == ["Hello!<|im_end|>\n", "Seven.<|im_end|>\n"]
    assert "".join(t for t, _ in parts) == ChatTemplate(CHATML).render(TALK)
    # Through the source: the trained targets decode to the assistant turns, nothing else.
    path = write_jsonl(tmp_path / "talk.jsonl", [{"messages": TALK}] * 4)
    cfg = load_config(None, ["data.name='chat'", f"data.path='{path}'", f"data.tokenizer='{hf_tokenizer}'",
                             "model.context=64", "model.name='llama'"])
    bundle = build_data(cfg.data, cfg.model)
    x, y = bundle.train.fetch(torch.arange(1))
    assert x.shape == (1, 64) and bundle.spec.masked_targets and not bundle.spec.packed
    text = bundle.tokenizer.decode(y[0][y[0] != IGNORE].tolist())
    assert text == "Hello!<|im_end|>\nSeven.<|im_end|>\n"
    assert bundle.stats == {"examples": 4, "truncated": 0, "limit_tokens": 65, "rows": {"train": 3, "val": 1},
                            "trained_tokens": 3 * 6}  # per turn: the words, <|im_end|>, the newline


def test_a_prompt_completion_pair_trains_the_completion_and_the_eos(hf_tokenizer):
    tok = CharTokenizer.fit("abc? xyz.</s>")
    parts = pieces("x", {"prompt": "abc?", "completion": " xyz."}, None, "</s>")
    ids, trained = encode(tok, parts)
    assert tok.decode(ids) == "abc? xyz.</s>" and trained.tolist() == [False] * 4 + [True] * 9
    x, y = rows([(ids, trained)], 16, pack=False)
    # Target j is token j + 1: the first trained target is the completion's first character, after the prompt's last.
    assert tok.decode(y[0][y[0] != IGNORE].tolist()) == " xyz.</s>" and (y[0][:3] == IGNORE).all()
    assert (y[0][12:] == IGNORE).all() and x[0, :12].tolist() == ids[:-1].tolist()


def test_the_loss_never_reads_a_prompt_position_and_is_a_mean_of_row_means():
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11, requires_grad=True)
    targets = torch.randint(0, 11, (4, 6))
    targets[0, :4] = targets[1, :1] = targets[2, :] = IGNORE  # row 2: nothing to train
    loss = masked_lm_loss(logits, targets)
    loss.backward()
    assert (logits.grad[targets == IGNORE] == 0).all() and (logits.grad[targets != IGNORE] != 0).any()
    per = torch.nn.functional.cross_entropy(logits.detach().flatten(0, 1), targets.clamp(min=0).flatten(),
                                            reduction="none").view(4, 6)
    keep = targets != IGNORE
    rows_mean = [float(per[r][keep[r]].mean()) if keep[r].any() else 0.0 for r in range(4)]
    assert loss.item() == pytest.approx(sum(rows_mean) / 4, rel=1e-6)
    # Split into micro-batches of 1 and 3 rows, each weighted by its share: the same loss (layout-independent).
    split = masked_lm_loss(logits[:1], targets[:1]) / 4 + masked_lm_loss(logits[1:], targets[1:]) * 3 / 4
    assert split.item() == pytest.approx(loss.item(), rel=1e-6)
    # A changed prompt logit changes nothing.
    bumped = logits.detach().clone()
    bumped[0, :4] += 5.0
    assert masked_lm_loss(bumped, targets).item() == loss.item()


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_packed_row_gives_each_example_its_own_logits(name):
    from plait.data.spec import DataSpec
    from plait.models.registry import build_model

    extra = ["model.sliding_window=3", "model.kv_heads=1"] if name == "llama" else []
    cfg = load_config(None, [f"model.name='{name}'", "model.layers=2", "model.width=32", "model.heads=2",
                             "model.context=24", "model.vocab_size=50", "model.tie_embeddings=false", *extra])
    torch.manual_seed(0)
    model = build_model(cfg.model, DataSpec(name="chat", task="lm", input_shape=[24], vocab_size=50)).eval()
    g = torch.Generator().manual_seed(1)
    examples = [(torch.randint(0, 50, (n,), generator=g).numpy(), torch.ones(n, dtype=torch.bool).numpy())
                for n in (6, 9, 5, 9)]  # 5 + 8 + 4 = 17 input tokens in the first row; 8 more do not fit
    x, y = rows(examples, 24, pack=True)
    assert x.shape == (2, 2, 24)
    assert x[0, 1, :17].tolist() == [*range(5), *range(8), *range(4)] and (x[0, 1, 17:] == 0).all()
    with torch.no_grad():
        packed = model(x)
        at = {0: 0, 1: 5, 2: 13}
        for i, (ids, _) in enumerate(examples):
            alone = model(torch.as_tensor(ids[:-1])[None])[0]
            row, start = (0, at[i]) if i < 3 else (1, 0)
            got = packed[row, start:start + len(ids) - 1]
            assert (got - alone).abs().max().item() <= 1e-5, (name, i)
    # Without the positions' confinement the first row's later examples would see the earlier ones.
    with torch.no_grad():
        flat = model(x[:, 0])
    assert (flat[0, 5:13] - packed[0, 5:13]).abs().max().item() > 1e-3


def test_truncation_is_counted_and_bad_input_is_refused(tmp_path):
    examples = chat_examples()
    path = write_jsonl(tmp_path / "c.jsonl", examples)
    cfg = load_config(None, ["data.name='chat'", f"data.path='{path}'", "model.context=32", "data.pack=true"])
    bundle = build_data(cfg.data, cfg.model)
    long = sum(len(e["prompt"] + e["completion"]) > 33 for e in examples)
    assert long and bundle.stats["truncated"] == long and bundle.stats["examples"] == 40
    x, y = bundle.train.fetch(torch.arange(2))
    assert x.shape == (2, 2, 32) and bundle.spec.packed
    assert bundle.stats["rows"]["train"] < 36  # packed: fewer rows than the 36 training examples

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    cfg = load_config(None, ["data.name='chat'", f"data.path='{bad}'"])
    with pytest.raises(DataError, match=r"bad.jsonl:2: an example is \{\"prompt\": str, \"completion\": str\}"):
        build_data(cfg.data, cfg.model)
    write_jsonl(bad, [{"messages": TALK}] * 3)
    cfg = load_config(None, ["data.name='chat'", f"data.path='{bad}'"])
    with pytest.raises(DataError, match="bad.jsonl:1: a conversation needs a chat template"):
        build_data(cfg.data, cfg.model)
    write_jsonl(bad, [{"messages": TALK[:2]}] * 3)
    with pytest.raises(DataError, match="bad.jsonl:1: the conversation has no 'assistant' message"):
        build_data(cfg.data, cfg.model)
    with pytest.raises(ConfigError, match="data.pack = true with parallel.pp = 2"):
        load_config(None, ["data.name='chat'", f"data.path='{path}'", "data.pack=true", "parallel.pp=2"])
    with pytest.raises(ConfigError, match="model.name = 'mlp' does not: set data.pack=false"):
        load_config(None, ["data.name='chat'", f"data.path='{path}'", "data.pack=true", "model.name='mlp'"])


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_micro_batch_cut_after_its_last_trained_target_has_the_same_loss_and_gradients(name):
    from plait.data.chat import trim_padding, trims_padding
    from plait.data.spec import DataSpec
    from plait.models.registry import build_model
    from plait.parallel import Layout

    cfg = load_config(None, [f"model.name='{name}'", "model.layers=2", "model.width=32", "model.heads=2",
                             "model.context=24", "model.vocab_size=50"])
    spec = DataSpec(name="chat", task="lm", input_shape=[24], vocab_size=50, masked_targets=True)
    torch.manual_seed(0)
    model = build_model(cfg.model, spec)
    g = torch.Generator().manual_seed(2)
    examples = [(torch.randint(0, 50, (n,), generator=g).numpy(), (torch.arange(n) >= 2).numpy()) for n in (7, 12, 4)]
    x, y = rows(examples, 24, pack=False)
    cut = trim_padding((x, y))
    assert cut[0].shape == (3, 11) and cut[1].shape == (3, 11)  # the longest row's 11 inputs, its last target at 10
    assert torch.equal(cut[1], y[:, :11]) and (y[:, 11:] == IGNORE).all()

    def loss_and_grads(batch):
        model.zero_grad()
        loss = masked_lm_loss(model(batch[0]), batch[1])
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    (full, g_full), (short, g_short) = loss_and_grads((x, y)), loss_and_grads(cut)
    torch.testing.assert_close(short, full, rtol=1e-6, atol=1e-7)
    for a, b in zip(g_short, g_full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert trim_padding(cut) == cut or all(torch.equal(a, b) for a, b in zip(trim_padding(cut), cut))  # already cut
    # only where shapes may vary: not packed rows, tensor, context or pipeline parallel, or a compiled model
    assert trims_padding(spec, Layout(dp=2, zero=3), compiled=False)
    for layout, compiled in ((Layout(tp=2), False), (Layout(cp=2), False), (Layout(pp=2), False), (Layout(), True)):
        assert not trims_padding(spec, layout, compiled)
    assert not trims_padding(DataSpec(name="chat", task="lm", input_shape=[24], masked_targets=True, packed=True),
                             Layout(), compiled=False)
