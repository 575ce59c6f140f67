"""Reference models and the registry: shapes, causality, parameter counts, factories and their errors."""

import re

import pytest
import torch
import torch.nn as nn

from plait.config import ModelConfig
from plait.data.spec import DataSpec
from plait.errors import ConfigError
from plait.models import build_model
from plait.models.gpt import GPT

V, C, W, H, L = 11, 8, 16, 2, 2  # vocab, context, width, heads, layers

TEXT = DataSpec(name="text", task="lm", input_shape=[C], vocab_size=V, tokens_per_sample=C)
DIGITS = DataSpec(name="digits", task="classification", input_shape=[1, 8, 8], num_classes=10)
FLAT = DataSpec(name="synthetic", task="classification", input_shape=[64], num_classes=10)


def model_cfg(**kw) -> ModelConfig:
    base = dict(layers=L, heads=H, width=W, context=C)
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture
def gpt() -> GPT:
    torch.manual_seed(0)
    return build_model(model_cfg(), TEXT).eval()


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied tensor counts once


# --------------------------------------------------------------------------- GPT


def test_gpt_output_shape(gpt):
    idx = torch.randint(0, V, (3, 5))
    out = gpt(idx)
    assert out.shape == (3, 5, V) and out.dtype == torch.float32
    assert gpt(torch.randint(0, V, (2, C))).shape == (2, C, V)
    assert isinstance(gpt.blocks, nn.ModuleDict) and list(gpt.blocks) == [str(i) for i in range(L)]


def test_tied_embeddings_share_storage(gpt):
    assert gpt.head.weight is gpt.tok_emb.weight
    assert gpt.head.weight.data_ptr() == gpt.tok_emb.weight.data_ptr()
    # state_dict still names both (the plain model's keys), but they are one tensor
    sd = gpt.state_dict()
    assert "head.weight" in sd and "tok_emb.weight" in sd
    assert sd["head.weight"].data_ptr() == sd["tok_emb.weight"].data_ptr()


def test_untied_embeddings_are_separate():
    torch.manual_seed(0)
    m = build_model(model_cfg(tie_embeddings=False), TEXT)
    assert m.head.weight is not m.tok_emb.weight
    assert m.head.weight.data_ptr() != m.tok_emb.weight.data_ptr()
    assert m.head.weight.shape == m.tok_emb.weight.shape == (V, W)
    assert not torch.equal(m.head.weight, m.tok_emb.weight)


def test_sequence_longer_than_context_is_refused(gpt):
    with pytest.raises(ValueError, match=re.escape(f"sequence length {C + 1} exceeds the model's context {C}")):
        gpt(torch.zeros(1, C + 1, dtype=torch.long))


def test_gpt_is_causal(gpt):
    idx = torch.randint(0, V, (4, C))
    changed = idx.clone()
    changed[:, 5:] = (changed[:, 5:] + 3) % V
    a, b = gpt(idx), gpt(changed)
    assert torch.equal(a[:, :5], b[:, :5])  # exactly: nothing at or after position 5 reaches earlier positions
    assert (a[:, 5:] - b[:, 5:]).abs().max() > 1e-3  # and the later positions did see the change


def test_gpt_prefix_logits_do_not_depend_on_sequence_length(gpt):
    idx = torch.randint(0, V, (2, C))
    full = gpt(idx)
    assert torch.allclose(gpt(idx[:, :3]), full[:, :3], atol=1e-6)


def test_generate_is_reproducible_and_adds_n_tokens(gpt):
    prompt = torch.randint(0, V, (2, 3))
    a = gpt.generate(prompt, 12, generator=torch.Generator().manual_seed(5))  # 3 + 12 > context: it crops
    b = gpt.generate(prompt, 12, generator=torch.Generator().manual_seed(5))
    assert a.shape == (2, 15) and a.dtype == torch.long
    assert torch.equal(a, b)
    assert torch.equal(a[:, :3], prompt)
    assert int(a.min()) >= 0 and int(a.max()) < V
    c = gpt.generate(prompt, 12, generator=torch.Generator().manual_seed(6))
    assert not torch.equal(a, c)
    assert gpt.generate(prompt, 0).shape == (2, 3)


def test_greedy_and_top1_sampling_agree(gpt):
    prompt = torch.randint(0, V, (3, 2))
    greedy = gpt.generate(prompt, 6, temperature=0)
    top1 = gpt.generate(prompt, 6, top_k=1, generator=torch.Generator().manual_seed(1))
    assert torch.equal(greedy, top1)
    # the first new token is the argmax of the last position's logits
    assert torch.equal(greedy[:, 2], gpt(prompt)[:, -1].argmax(-1))


def gpt_params_formula(vocab, context, width, layers, tied):
    emb = vocab * width + context * width
    attn = 4 * (width * width + width)  # q, k, v, proj: weight + bias
    mlp = (width * 4 * width + 4 * width) + (4 * width * width + width)  # up and down, with biases
    norms = 2 * (2 * width)  # ln1, ln2: weight + bias
    final_norm = 2 * width
    head = 0 if tied else vocab * width  # no bias
    return emb + layers * (attn + mlp + norms) + final_norm + head


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("vocab, context, width, heads, layers", [(11, 8, 16, 2, 2), (97, 32, 24, 3, 3),
                                                                  (65, 128, 128, 4, 4)])
def test_gpt_parameter_count(tied, vocab, context, width, heads, layers):
    m = GPT(vocab, context, width, heads, layers, tie_embeddings=tied)
    assert n_params(m) == gpt_params_formula(vocab, context, width, layers, tied)
    assert n_params(m) == vocab * width * (1 if tied else 2) + context * width + layers * (12 * width**2 + 13 * width) \
        + 2 * width


def test_default_gpt_size():
    # the default job: 4 blocks of width 128, context 128, on a 100-character vocabulary
    m = build_model(ModelConfig(), DataSpec(name="t", task="lm", input_shape=[128], vocab_size=100))
    assert n_params(m) == 100 * 128 + 128 * 128 + 4 * (12 * 128 * 128 + 13 * 128) + 2 * 128 == 822_528


def test_gpt_init():
    torch.manual_seed(0)
    m = GPT(V, C, W, H, L)
    for name, p in m.named_parameters():
        if name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        elif p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p)), name  # LayerNorm weights
    assert m.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.15)


def test_vocab_size_from_the_data_or_the_config():
    assert build_model(model_cfg(vocab_size=0), TEXT).tok_emb.weight.shape == (V, W)
    assert build_model(model_cfg(vocab_size=16), TEXT).head.weight.shape == (16, W)
    with pytest.raises(ConfigError, match=re.escape(
            f"model.vocab_size = 5 is smaller than the data's vocabulary ({V}); set model.vocab_size=0")):
        build_model(model_cfg(vocab_size=5), TEXT)


# --------------------------------------------------------------------------- MLP and CNN


def test_mlp_on_digits():
    torch.manual_seed(0)
    m = build_model(ModelConfig(name="mlp", width=32, depth=2), DIGITS)
    assert m(torch.rand(5, 1, 8, 8)).shape == (5, 10)
    assert len(m.blocks) == 2
    assert n_params(m) == (64 * 32 + 32) + (32 * 32 + 32) + (32 * 10 + 10)
    flat = build_model(ModelConfig(name="mlp", width=8, depth=1), FLAT)
    assert flat(torch.rand(3, 64)).shape == (3, 10)


def test_cnn_on_digits():
    torch.manual_seed(0)
    m = build_model(ModelConfig(name="cnn", width=8, depth=3), DIGITS)
    x = torch.rand(5, 1, 8, 8)
    out = m(x)
    assert out.shape == (5, 10)
    assert len(m.blocks) == 3
    conv1 = 1 * 8 * 9 + 8
    conv = 8 * 8 * 9 + 8
    gn = 2 * 8
    assert n_params(m) == conv1 + gn + 2 * (conv + gn) + (8 * 10 + 10)
    # per-sample normalisation: a sample's output does not depend on the rest of the batch
    assert torch.allclose(m(x[:2]), out[:2], atol=1e-6)


def test_cnn_rejects_flat_inputs():
    with pytest.raises(ConfigError, match=re.escape(
            "model.name = 'cnn' needs image-shaped samples (channels, height, width); data.name = 'synthetic' "
            "gives samples of shape (64,); use model.name = 'mlp'")):
        build_model(ModelConfig(name="cnn"), FLAT)


def test_unknown_model_name():
    with pytest.raises(ConfigError, match=re.escape("model.name = 'resnet' is not one of: cnn, deepfm, gpt, llama, mlp")):
        build_model(ModelConfig(name="resnet"), DIGITS)


# --------------------------------------------------------------------------- factories


def test_factory_builds_the_users_module():
    cfg = ModelConfig(name="ignored", factory="torch.nn:Linear", options={"in_features": 4, "out_features": 2})
    m = build_model(cfg, DIGITS)
    assert type(m) is nn.Linear
    assert m.weight.shape == (2, 4) and m.bias.shape == (2,)
    seq = build_model(ModelConfig(factory="torch.nn:Identity"), DIGITS)
    x = torch.rand(3, 4)
    assert type(seq) is nn.Identity and torch.equal(seq(x), x)


@pytest.mark.parametrize(
    "factory, options, message",
    [
        ("no_such_module_for_plait:build", {},
         "model.factory = 'no_such_module_for_plait:build': cannot import module 'no_such_module_for_plait'"),
        ("torch.nn:NoSuchLayer", {}, "model.factory = 'torch.nn:NoSuchLayer': torch.nn has no callable 'NoSuchLayer'"),
        ("math:pi", {}, "model.factory = 'math:pi': math has no callable 'pi'"),
        ("builtins:dict", {"a": 1}, "model.factory = 'builtins:dict' returned dict, not an nn.Module"),
    ],
)
def test_factory_errors(factory, options, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_model(ModelConfig(factory=factory, options=options), DIGITS)
