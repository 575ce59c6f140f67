"""plait's llama against transformers: Llama, Qwen2, Mistral and Mixtral checkpoints in (logits, greedy generation
with the KV cache), and a trained run back out as a Hugging Face directory that from_pretrained loads.

Every checkpoint is made here, tiny, with every weight drawn at random (norms and biases included), so that no
mapping error hides behind zeros and ones.
"""

import copy
import json

import pytest
import torch

from plait.data.spec import DataSpec
from plait.errors import ConfigError
from plait.models import build_model
from plait.models.hf import load_hf_model
from plait.train.job import load_job
from plait.train.weights import init_from

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 100, 24
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
ARCHS = {
    "llama-gqa-untied-llama3rope": ("Llama", dict(rope_scaling=LLAMA3, rope_theta=5e5)),
    "llama-mqa-linear-rope": ("Llama", dict(num_key_value_heads=1, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama-dynamic-rope-tied": ("Llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                                              max_position_embeddings=16, tie_word_embeddings=True)),
    "qwen2-qkv-bias": ("Qwen2", dict(tie_word_embeddings=True)),
    "mistral-window-5": ("Mistral", dict(sliding_window=5)),
    "mixtral-top2-of-4": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
}
TOL = 1e-5  # max |difference| <= TOL * max(1, |logit|)


def make(kind: str, kw: dict, d):
    config = getattr(transformers, f"{kind}Config")(**json.loads(json.dumps({**BASE, **kw})))  # it edits what it is given
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}ForCausalLM")(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(d)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-llama")
    out = {}
    for name, (kind, kw) in ARCHS.items():
        out[name] = (make(kind, kw, root / name), root / name)
    return out


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(1, |b|)."""
    return float(((a - b).abs() / b.abs().clamp(min=1)).max())


IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", list(ARCHS))
def test_logits_and_greedy_generation_equal_transformers(checkpoints, name):
    ref, d = checkpoints[name]
    cfg, _, model, _ = load_hf_model(d)
    model.eval()
    assert cfg.name == "llama" and model.tok_emb.weight.shape[0] == 128  # 100 padded to a multiple of 64
    with torch.no_grad():
        want = ref(IDS).logits
        got = model(IDS)
        assert got.shape == want.shape  # the padding is not in the logits
        diff = close(got, want)
        print(f"{name}: max |plait - transformers| logits = {diff:.3g}")
        assert diff <= TOL
        prompt = IDS[:, :6]
        want = ref.generate(prompt, max_new_tokens=30, do_sample=False)
        got = model.generate(prompt, 30, temperature=0)
    assert got.tolist() == want.tolist()  # 36 tokens: past the 16 a dynamic rope was built for, and the window


def test_init_from_sets_the_model_keys_and_loads_the_weights(checkpoints):
    ref, d = checkpoints["mixtral-top2-of-4"]
    cfg = load_job(None, [f"train.init_from='{d}'"])
    m = cfg.model
    assert (m.name, m.layers, m.heads, m.kv_heads, m.width, m.hidden, m.context, m.vocab_size, m.moe_experts,
            m.moe_top_k, m.tie_embeddings, m.rope_theta) == ("llama", 2, 4, 2, 32, 48, 64, 100, 4, 2, False, 1e6)
    model = build_model(m, DataSpec(name="x", task="lm", input_shape=[64], vocab_size=90)).eval()
    init_from(model, d)
    with torch.no_grad():
        assert close(model(IDS), ref(IDS).logits) <= TOL


def test_bf16_and_sharded_checkpoints_load(checkpoints, tmp_path):
    ref, _ = checkpoints["qwen2-qkv-bias"]
    d = tmp_path / "bf16"
    copy.deepcopy(ref).to(torch.bfloat16).save_pretrained(d, max_shard_size="20KB")
    assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("model-*.safetensors"))) > 1
    _, _, model, _ = load_hf_model(d)
    want = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        assert close(model.eval()(IDS), want(IDS).logits) <= TOL


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported; plait's llama has SwiGLU (silu)"),
    ({"mlp_bias": True}, "mlp_bias = true is not supported by plait's llama (its feed-forward has no biases)"),
    ({"head_dim": 16}, "head_dim = 16 but plait's llama has hidden_size / num_attention_heads = 8"),
    ({"architectures": ["FalconForCausalLM"]}, "architecture 'FalconForCausalLM' is not supported; plait loads "
     "LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, MixtralForCausalLM and GPT-2-family checkpoints"),
])
def test_an_unsupported_config_names_the_flag(checkpoints, tmp_path, change, message):
    _, src = checkpoints["llama-gqa-untied-llama3rope"]
    config = {**json.loads((src / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        load_job(None, [f"train.init_from='{tmp_path}'"])
    assert message in str(e.value)


def test_tp_check_names_the_key_that_does_not_split():
    from plait.models.llama import Llama

    with pytest.raises(ConfigError, match=r"^model.kv_heads \(1\) is not divisible by parallel.tp = 2"):
        Llama(100, 16, 32, 4, 1, kv_heads=1).tp_check(2)
    with pytest.raises(ConfigError, match=r"^model.vocab_multiple \(the padded vocabulary\) \(102\) is not divisible "
                                          r"by parallel.tp = 4"):
        Llama(101, 16, 32, 4, 1, vocab_multiple=3).tp_check(4)
    Llama(101, 16, 64, 8, 1).tp_check(8)  # 101 -> 128 rows


def test_a_lora_run_exported_as_hf_gives_its_logits_in_transformers(checkpoints, tmp_path):
    """Fine-tune a Llama checkpoint with LoRA on q_proj/v_proj (SGD, a step large enough to move the adapters), export
    with --format hf (adapters merged): from_pretrained gives the run's logits; the config is the checkpoint's."""
    from plait.cli import main
    from plait.train.weights import load_run_model

    _, d = checkpoints["llama-gqa-untied-llama3rope"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(chr(32 + i % 90) for i in range(3000)))
    sets = [f"train.init_from='{d}'", "data.name=text", f"data.path='{corpus}'", "model.vocab_size=0", "model.context=16",
            "train.steps=2", "optim.name=sgd", "optim.lr=0.5", "parallel.dp=1", "train.global_batch_size=4",
            "train.micro_batch_size=4", "train.eval_samples=4", "train.sample_tokens=0", "log.progress=false",
            "log.report=false", "checkpoint.every=2", "finetune.lora_rank=2", "finetune.lora_targets=['q_proj', 'v_proj']"]
    args = ["train", "--out", str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    assert main(["export", str(tmp_path / "run"), "-o", str(tmp_path / "hf"), "--format", "hf"]) == 0
    _, _, model = load_run_model(tmp_path / "run")
    out = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(out).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        mine, theirs = model.eval()(IDS[:, :16]), out(IDS[:, :16]).logits
        start = checkpoints["llama-gqa-untied-llama3rope"][0](IDS[:, :16]).logits
    print(f"exported: max |plait - transformers| = {close(theirs, mine):.3g}; moved {close(mine, start):.3g}")
    assert close(theirs, mine) <= TOL
    assert close(mine, start) > 1e-3  # the adapters moved the model: the export is the fine-tuned one
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_scaling"] == LLAMA3 and config["num_key_value_heads"] == 2 and config["vocab_size"] == VOCAB
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(out.state_dict())


@pytest.mark.parametrize("name", ["mixtral-top2-of-4", "qwen2-qkv-bias", "mistral-window-5"])
def test_the_hf_mapping_round_trips(checkpoints, tmp_path, name):
    """to_hf(plait's state) saved and read by transformers gives the same logits, for each family's class."""
    from safetensors.torch import save_file

    from plait.models.hf_llama import to_hf

    ref, d = checkpoints[name]
    cfg, _, model, _ = load_hf_model(d)
    config, tensors = to_hf(cfg, model.state_dict())
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back).__name__ == type(ref).__name__
    with torch.no_grad():
        assert close(back(IDS).logits, ref(IDS).logits) <= TOL


def test_the_fused_rotation_of_a_serving_step_gives_the_formula_and_nothing_else_changes():
    """Hugging Face's rotate_half formula everywhere (training, generate, a preference run's reference pass: bit for
    bit); a serving step without autograd asks for the fused one, one tensor and two in-place products: the same
    within float32's rounding, on a strided (b, h, t, d) view as the attention hands it over."""
    from plait.models.llama import rotate

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 7, 3, 16, generator=g).transpose(1, 2)  # (b, h, t, d), not contiguous
    angles = torch.randn(1, 1, 7, 8, generator=g)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    want = x * cos + torch.cat([-x[..., 8:], x[..., :8]], dim=-1) * sin
    torch.testing.assert_close(rotate(x, cos, sin), want, atol=0, rtol=0)
    torch.testing.assert_close(rotate(x, cos, sin, fused=True), want, atol=0, rtol=0)  # autograd on: the formula
    with torch.no_grad():
        torch.testing.assert_close(rotate(x, cos, sin), want, atol=0, rtol=0)
        got = rotate(x, cos, sin, fused=True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert not torch.equal(x, got) and x.shape == got.shape
