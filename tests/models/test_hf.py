"""Hugging Face GPT-2 checkpoints: plait's GPT loaded from a local GPT2LMHeadModel directory gives transformers' logits."""

import json

import httpx
import pytest
import torch

from plait.config import load_config
from plait.data.spec import DataSpec
from plait.errors import ConfigError
from plait.models import build_model
from plait.train.job import load_job
from plait.train.weights import init_from

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

CORPUS = "def add(a, b):\n    return a + b\n\nclass Point:\n    x = 0\n    y = 1\n" * 20
TOL = 1e-5


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A randomly initialised GPT2LMHeadModel (every parameter drawn, biases and LayerNorms included, so no
    mapping error hides behind zeros and ones), saved with a BPE tokenizer trained here; its logits on fixed tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(d)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=90, special_tokens=["[UNK]"]))
    tok.save(str(d / "tokenizer.json"))
    ids = torch.randint(0, 100, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    return {"dir": d, "model": model, "ids": ids, "logits": logits, "tokenizer": tok}


def test_init_from_gives_transformers_logits(hf):
    cfg = load_job(None, [f"train.init_from='{hf['dir']}'"])  # config.json sets [model]
    m = cfg.model
    assert (m.layers, m.heads, m.width, m.context, m.vocab_size, m.activation, m.tie_embeddings) == (
        2, 4, 32, 64, 100, "gelu_tanh", True)
    assert cfg.data.tokenizer == str(hf["dir"] / "tokenizer.json")
    model = build_model(m, DataSpec(name="x", task="lm", input_shape=[64], vocab_size=90)).eval()
    init_from(model, hf["dir"])
    with torch.no_grad():
        diff = (model(hf["ids"]) - hf["logits"]).abs().max().item()
    print(f"max |plait - transformers| logits (init_from) = {diff:.3g}")
    assert diff <= TOL
    # A shorter context keeps the first positions: the same logits on the first 16 tokens.
    cfg = load_job(None, [f"train.init_from='{hf['dir']}'", "model.context=16"])
    short = build_model(cfg.model, DataSpec(name="x", task="lm", input_shape=[16], vocab_size=90)).eval()
    init_from(short, hf["dir"])
    with torch.no_grad():
        assert (short(hf["ids"][:, :16]) - hf["logits"][:, :16]).abs().max().item() <= TOL


def test_pytorch_model_bin_and_untied_head(hf, tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    config = json.loads((hf["dir"] / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    state = {f"transformer.{k}": v.clone() for k, v in hf["model"].transformer.state_dict().items()}
    state["lm_head.weight"] = hf["model"].lm_head.weight.detach().clone()
    torch.save(state, d / "pytorch_model.bin")
    cfg = load_job(None, [f"train.init_from='{d}'"])
    assert cfg.model.tie_embeddings is False
    model = build_model(cfg.model, DataSpec(name="x", task="lm", input_shape=[64], vocab_size=100)).eval()
    init_from(model, d)
    with torch.no_grad():
        assert (model(hf["ids"]) - hf["logits"]).abs().max().item() <= TOL


def test_a_conflicting_model_override_names_both_values(hf):
    with pytest.raises(ConfigError) as e:
        load_job(None, [f"train.init_from='{hf['dir']}'", "model.width=64"])
    assert str(e.value) == (f"model.width = 64 conflicts with n_embd = 32 in {hf['dir'] / 'config.json'}; "
                            "drop the model.width override (the checkpoint sets it)")
    with pytest.raises(ConfigError, match=r"^model.name = 'mlp' conflicts with architecture = 'GPT2LMHeadModel' in "):
        load_job(None, [f"train.init_from='{hf['dir']}'", "model.name=mlp"])
    with pytest.raises(ConfigError) as e:
        load_job(None, [f"train.init_from='{hf['dir']}'", "model.context=100"])
    assert str(e.value) == (f"model.context = 100 conflicts with n_positions = 64 in {hf['dir'] / 'config.json'}: the "
                            "checkpoint has no positions beyond it; set model.context <= 64")


def test_a_missing_tokenizer_is_refused_before_launch(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_job(None, ["data.name=text", f"data.path='{tmp_path}'", f"data.tokenizer='{tmp_path / 'nope.json'}'"])
    assert str(e.value) == (f"data.tokenizer = '{tmp_path / 'nope.json'}' does not exist; give a Hugging Face "
                            "tokenizer.json")


def test_unsupported_architecture_is_one_line_and_exit_2(hf, tmp_path, monkeypatch, capsys):
    from plait.cli import main

    llama = tmp_path / "falcon"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"], "model_type": "falcon"}))
    monkeypatch.chdir(tmp_path)
    message = (f"train.init_from = '{llama}': architecture 'FalconForCausalLM' is not supported; plait loads "
               "LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, MixtralForCausalLM and GPT-2-family "
               "checkpoints (GPT2LMHeadModel, GPT2Model: gpt2, distilgpt2, ...)")
    assert main(["train", "--set", f"train.init_from={llama}", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: {message}"
    assert not (tmp_path / "run").exists()
    assert main(["serve", str(llama)]) == 2
    assert capsys.readouterr().err.strip() == "error: " + message.replace("train.init_from =", "plait serve")


def test_serve_gives_transformers_logits_and_generates_with_the_tokenizer(hf):
    from plait.serve.entrypoints.server import ServerThread

    ids = hf["ids"]
    body = {"inputs": [{"name": "input_ids", "shape": list(ids.shape), "datatype": "INT64", "data": ids.reshape(-1).tolist()}]}
    prompt = "def add(a, b):"
    prompt_ids = hf["tokenizer"].encode(prompt).ids
    want = list(prompt_ids)
    with torch.no_grad():  # transformers' greedy continuation
        for _ in range(8):
            want.append(int(hf["model"](torch.tensor([want])).logits[0, -1].argmax()))
    want = want[len(prompt_ids):]
    with ServerThread(hf["dir"]) as srv:
        r = httpx.post(f"{srv.url}/v2/models/gpt/infer", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
        logits = torch.tensor(out["data"]).reshape(out["shape"])
        diff = (logits - hf["logits"]).abs().max().item()
        print(f"max |plait serve - transformers| logits (OIP infer) = {diff:.3g}")
        assert diff <= TOL
        g = httpx.post(f"{srv.url}/v1/generate", json={"prompt": prompt, "max_new_tokens": 8, "temperature": 0},
                       timeout=60).json()
    assert g["tokens"] == want
    assert g["text"] == hf["tokenizer"].decode(want, skip_special_tokens=False)


def test_text_data_is_encoded_with_the_checkpoints_tokenizer(hf, tmp_path):
    from plait.data import build_data

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    cfg = load_job(None, [f"train.init_from='{hf['dir']}'", "data.name=text", f"data.path='{corpus}'",
                          "model.context=16", "data.val_fraction=0.2"])
    bundle = build_data(cfg.data, cfg.model)
    cut = int(len(CORPUS) * 0.8)
    assert bundle.train.tokens.tolist() == hf["tokenizer"].encode(CORPUS[:cut]).ids
    assert bundle.spec.vocab_size == hf["tokenizer"].get_vocab_size() and bundle.tokenizer.decode([5, 6]) == \
        hf["tokenizer"].decode([5, 6])


def test_a_run_from_the_checkpoint_keeps_its_weights_and_tokenizer(hf, tmp_path):
    """init_from inside train() (a step too small to move a weight): the run's model is transformers' model and
    its tokenizer.json, which serving and exports read, is the checkpoint's."""
    from plait.serve.model.load import ModelRef, load_model
    from plait.train.trainer import train
    from plait.train.weights import load_run_model

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    cfg = load_config(None, [f"train.init_from='{hf['dir']}'", "data.name=text", f"data.path='{corpus}'",
                             "model.context=16", "train.steps=1", "optim.name=sgd", "optim.lr=1e-20", "parallel.dp=1",
                             "train.global_batch_size=4", "train.micro_batch_size=4", "train.eval_samples=4",
                             "train.sample_tokens=4", "log.progress=false", "log.report=false", "checkpoint.every=1"])
    train(cfg, tmp_path / "run")
    _, _, model = load_run_model(tmp_path / "run")
    with torch.no_grad():
        assert (model.eval()(hf["ids"][:, :16]) - hf["logits"][:, :16]).abs().max().item() <= TOL
    assert (tmp_path / "run" / "tokenizer.json").read_text() == hf["tokenizer"].to_str()
    served = load_model(ModelRef(str(tmp_path / "run")))
    assert served.can_generate and served.tokenizer.encode("def add").tolist() == hf["tokenizer"].encode("def add").ids


def test_gelu_tanh_is_the_only_difference_from_the_default_block():
    cfg = load_config(None, ["model.layers=1", "model.width=8", "model.heads=2", "model.context=4", "model.vocab_size=10"])
    spec = DataSpec(name="x", task="lm", input_shape=[4], vocab_size=10)
    torch.manual_seed(0)
    exact = build_model(cfg.model, spec)
    cfg.model.activation = "gelu_tanh"
    torch.manual_seed(0)
    tanh = build_model(cfg.model, spec)
    x = torch.randn(3, 8)
    mlp_e, mlp_t = exact.blocks["0"].mlp, tanh.blocks["0"].mlp
    assert torch.equal(mlp_t(x), mlp_t.down(torch.nn.functional.gelu(mlp_t.up(x), approximate="tanh")))
    assert not torch.equal(mlp_e(x), mlp_t(x))



def test_asking_whether_a_plait_model_is_a_transformers_one_imports_nothing():
    """A rank with transformers imported (its tokenizers, a warm fork server) asks of every model whether it is a
    PreTrainedModel (tensor and pipeline parallel, the sample, init_from): for plait's own models the answer must not
    import transformers.modeling_utils (1.5-2 s of CPU; it was 40 % of a tensor-parallel test rank's time)."""
    import subprocess
    import sys

    code = ("import sys, transformers\n"
            "from plait.models.protocols import is_transformers_model, tensor_parallel_plan\n"
            "from plait.models.gpt import GPT\n"
            "m = GPT(vocab_size=64, context=16, width=32, heads=2, layers=1)\n"
            "assert not is_transformers_model(m) and tensor_parallel_plan(m) is not None\n"
            "print(sorted(k for k in sys.modules if k.startswith('transformers.modeling')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
