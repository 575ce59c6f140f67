"""The vision-language model (model.name = "vlm"): each connector against a reference, the zero-shot readout, the
captions, and dp / ZeRO-3 (with and without a frozen language model) on the one-process trajectory."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from helpers import PLAIN_SGD, assert_follows, params_after, rank0_params, step_losses
from plait.config import load_config
from plait.data.captions import IDS, VOCAB
from plait.data.sources import build_data
from plait.errors import ConfigError
from plait.models import build_model
from plait.models.gpt import GPT
from plait.models.vlm import CrossAttention, QFormer, zero_shot_accuracy
from plait.train.job import check_job
from plait.train.loss import masked_lm_loss

VLM = ["data.name=digit-captions", "model.name=vlm", "model.width=16", "model.heads=2", "model.layers=1",
       "model.depth=1", "train.steps=4", "train.global_batch_size=8", "train.eval_samples=16", "train.eval_batch_size=8",
       "train.eval_every=0", "log.progress=false", "log.report=false", "log.every=1", *PLAIN_SGD]


def vlm_config(*more: str):
    return load_config(None, [*VLM, *more])


def model_and_batch(connector: str, rows: int = 4):
    cfg = vlm_config(f"model.connector={connector}")
    bundle = build_data(cfg.data, cfg.model)
    torch.manual_seed(0)
    model = build_model(cfg.model, bundle.spec)
    x, y = bundle.train.fetch(torch.arange(rows))
    return model, x, y


def test_captions_name_the_digit_its_ink_and_its_turn():
    cfg = vlm_config()
    bundle = build_data(cfg.data, cfg.model)
    x, y = bundle.train.fetch(torch.arange(len(bundle.train)))
    assert x.shape[1] == 64 + 9 and bundle.spec.vocab_size == len(VOCAB) == 22
    words = [[VOCAB[int(i)] for i in row[64:]] for row in x[:200]]
    assert all(w[:3] == ["<bos>", "a", "handwritten"] and w[4] == "," and w[5] in ("bold", "thin") for w in words)
    assert {w[7] for w in words} == {"upright", "rotated"}
    assert torch.equal(y[:, :-1][y[:, :-1] != -100], x[:, 65:].long()[y[:, :-1] != -100])  # targets: the next token
    assert int((y == IDS["<eos>"]).sum()) == len(y)  # one end per caption


def test_gated_cross_attention_at_zero_is_the_language_model():
    model, x, y = model_and_batch("cross_attention")
    _, ids = model.split(x)
    alone = copy.deepcopy(model.lm)
    out, ref = model(x), alone(ids)
    assert torch.equal(out, ref)  # tanh(0) = 0: the untrained model is the LM exactly
    masked_lm_loss(out, y).backward()
    masked_lm_loss(ref, y).backward()
    for (n, p), (_, q) in zip(model.lm.named_parameters(), alone.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)
    gated = model.connector["0"]
    assert float(gated.attn_gate.grad.abs()) > 0 and float(gated.ffn_gate.grad.abs()) > 0
    assert all(float(p.grad.abs().max()) == 0 for p in gated.attn.parameters())  # behind a closed gate
    assert all(p.grad is None or float(p.grad.abs().max()) == 0 for p in model.encoder.parameters())


def test_projection_is_the_language_model_on_projected_image_tokens():
    """The reference: plait's GPT with the sample's projected image tokens as extra vocabulary rows, read first; the
    loss's gradient reaching those rows is the one reaching the projected tokens."""
    model, x, y = model_and_batch("projection", rows=2)
    images, ids = model.split(x)
    seen: list[torch.Tensor] = []

    def keep(module, args, output) -> None:  # the projected image tokens, with their gradient
        output.retain_grad()
        seen.append(output)

    model.connector.register_forward_hook(keep)
    out = model(x)
    masked_lm_loss(out, y).backward()
    prefix = seen[0]
    lm, v, p = model.lm, model.lm.vocab_size, prefix.shape[1]
    for i in range(2):
        ref = GPT(v + p, lm.context, 16, 2, 1)
        state = {k: t.clone() for k, t in lm.state_dict().items()}
        state["tok_emb.weight"] = torch.cat([lm.tok_emb.weight.detach(), prefix[i].detach()])
        state["head.weight"] = state["tok_emb.weight"]
        ref.load_state_dict(state)
        seq = torch.cat([torch.arange(v, v + p), ids[i]])[None]
        logits = ref(seq)[:, p:, :v]
        torch.testing.assert_close(out[i], logits[0], rtol=1e-5, atol=1e-6)
        (masked_lm_loss(logits, y[i:i + 1]) / 2).backward()  # sample i's share of the batch's mean
        torch.testing.assert_close(prefix.grad[i], ref.tok_emb.weight.grad[v:], rtol=1e-4, atol=1e-7)


def attention_by_hand(attn: CrossAttention, x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v per head, written out."""
    b, t, w = x.shape
    d = w // attn.heads
    q = attn.q(x).view(b, t, attn.heads, d).transpose(1, 2)
    k, v = (lin(mem).view(b, mem.shape[1], attn.heads, d).transpose(1, 2) for lin in (attn.k, attn.v))
    return attn.proj((torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5, -1) @ v).transpose(1, 2).reshape(b, t, w))


def test_qformer_reads_the_image_as_a_set_through_attention():
    torch.manual_seed(0)
    attn = CrossAttention(8, 2, 6)
    x, mem = torch.randn(3, 4, 8), torch.randn(3, 5, 6, requires_grad=True)
    torch.testing.assert_close(attn(x, mem), attention_by_hand(attn, x, mem))
    qf = QFormer(6, 8, queries=3, heads=2)
    out = qf(mem)
    q = qf.queries.expand(3, -1, -1)
    q = attention_by_hand(qf.cross, qf.ln1(q), mem)
    h = qf.ln2(q)
    q = q + attention_by_hand(qf.self_attn, h, h)
    want = qf.out(q + qf.ffn(qf.ln3(q)))
    torch.testing.assert_close(out, want)
    weights = torch.randn_like(out)
    got = torch.autograd.grad((out * weights).sum(), [mem, *qf.parameters()])
    ref = torch.autograd.grad((want * weights).sum(), [mem, *qf.parameters()])
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    assert out.shape == (3, 3, 8)
    torch.testing.assert_close(qf(mem[:, torch.randperm(5)]), out)  # no order among the image tokens of its own
    assert float((out[0] - out[1]).abs().max().detach()) > 1e-3  # and they reach every query


def test_zero_shot_reads_the_digit_word_after_the_prompt():
    words = torch.tensor([IDS[w] for w in ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
                                           "nine")])

    class Fixed(nn.Module):
        def forward(self, x):
            logits = torch.zeros(len(x), 9, len(VOCAB))
            logits[torch.arange(len(x)), 2, words[x[:, 0].long()]] = 1.0  # the digit named by the first pixel
            logits[:, 2, IDS["a"]] = 5.0  # not a digit word: never the answer
            return logits

    class Rows:
        def __len__(self):
            return 6

        def fetch(self, idx):
            x = torch.tensor([[3.0], [3.0], [7.0], [1.0], [1.0], [0.0]])[idx]
            y = torch.zeros(len(idx), 9, dtype=torch.long)
            y[:, 2] = words[torch.tensor([3, 4, 7, 1, 2, 0])[idx]]
            return x, y

    assert zero_shot_accuracy(Fixed(), Rows(), samples=6, batch=4) == pytest.approx(4 / 6)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-one")
    out = {}
    for name, more in CASES.items():
        run = root / name
        out[name] = params_after(vlm_config("parallel.dp=1", "train.micro_batch_size=4", *more), run), step_losses(run)
    return out


CASES = {"projection": ["model.connector=projection"], "cross_attention": ["model.connector=cross_attention"],
         "qformer": ["model.connector=qformer"], "frozen_lm": ["model.connector=qformer", "finetune.freeze=['lm.*']"]}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("zero", [0, 3], ids=["ddp", "zero3"])
def test_vision_language_training_follows_one_process(pool2, tmp_path, one_process, case, zero):
    run = tmp_path / "dp2"
    got = pool2.run(rank0_params, vlm_config("parallel.dp=2", f"parallel.zero={zero}", "train.micro_batch_size=2",
                                             *CASES[case]), run)[0]
    assert_follows(one_process[case], got, run, steps=4, rel=1e-5, atol=1e-6)
    if case == "frozen_lm":  # the language model is where it started; the connector is not
        torch.manual_seed(vlm_config().train.seed)
        start = build_model(vlm_config(*CASES[case]).model, build_data(vlm_config().data, None).spec).state_dict()
        assert all(torch.equal(got[k], start[k]) for k in got if k.startswith("lm."))
        assert not torch.equal(got["connector.queries"], start["connector.queries"])


def test_the_vlm_needs_captioned_images():
    with pytest.raises(ConfigError) as e:
        check_job(vlm_config("data.name=digits", "parallel.dp=1", "train.micro_batch_size=8"))
    assert str(e.value) == ("model.name = 'vlm' cannot train on data.name = 'digits': it needs data.name = "
                            "'digit-captions'; change model.name or data.name")
