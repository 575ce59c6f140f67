"""The end of a run never loses it, and its sample is the trained model's whatever the model (issue 57 items 1, 4, 5):
summary.json and the report are written before the sample, and a sample that fails is one warning line; LoRA, QLoRA
and bottleneck adapters on a Hugging Face Llama directory with the default targets end with a sample; a transformers
model given as model.factory samples through its forward (fresh, or from_pretrained with LoRA); a chat run's sample
is a turn through the tokenizer's chat template that ends at the end-of-sequence token."""

from __future__ import annotations

import json

import pytest
import torch

from hf_helpers import CORPUS, TEMPLATE, corpus, llama_dir, sets
from plait.config import load_config
from plait.data.chat import ChatTemplate
from plait.data.hf_tokenizer import HFTokenizer
from plait.train.sample import TEMPERATURE, TOP_K, token_by_token
from plait.train.trainer import train
from plait.train.weights import load_run_model

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

Q_V = 4 * (32 + 32) + 4 * (32 + 16)  # rank 4 on q_proj (32 -> 32) and v_proj (32 -> 16, two kv heads of 8)
ADAPTER = (32 * 4 + 4) + (4 * 32 + 32)  # down (32 -> 4) and up (4 -> 32), after o_proj and down_proj


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"dir": llama_dir(root / "llama"), "corpus": corpus(root), "tok": HFTokenizer.from_file(root / "llama" /
                                                                                                  "tokenizer.json")}


def trained(run_dir, *items: str):
    """Train in this process as configured; (its summary.json, the run directory)."""
    train(load_config(None, sets(*items)), run_dir)
    return json.loads((run_dir / "summary.json").read_text()), run_dir


def on_hf(hf, *items: str) -> tuple[str, ...]:
    return (f"train.init_from='{hf['dir']}'", "data.name='text'", f"data.path='{hf['corpus']}'", *items)


def continuation(run_dir, tok, prompt: str, n: int, seed: int = 1234) -> str:
    """What the run's merged model continues `prompt` with, seeded as the sample is."""
    _, _, model = load_run_model(run_dir)
    ids = torch.tensor(tok.encode(prompt).astype("int64"))[None]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        out = model.eval().generate(ids, n, temperature=TEMPERATURE, top_k=TOP_K, generator=g)
    return tok.decode(out[0].tolist())


@pytest.mark.parametrize("items, trainable", [
    (["finetune.lora_rank=4"], 2 * Q_V),
    (["finetune.lora_rank=4", "finetune.quantize_base='nf4'"], 2 * Q_V),
    (["finetune.adapters={size=4}"], 2 * 2 * ADAPTER),
], ids=["lora", "qlora", "adapters"])
def test_a_finetuned_hf_llama_ends_with_its_summary_report_and_sample(hf, tmp_path, items, trainable):
    if "nf4" in items[-1]:
        pytest.importorskip("bitsandbytes")
    summary, run = trained(tmp_path / "run", *on_hf(hf, *items))
    assert summary["steps"] == 3 and summary["trainable_params"] == trainable
    assert summary["sample"] == continuation(run, hf["tok"], "def ", 12)
    assert "<h2>sample</h2>" in (run / "report.html").read_text()
    targets = load_config(run / "config.toml").finetune.lora_targets
    assert targets == (["q_proj", "v_proj"] if "lora_rank" in items[0] else [])  # the run records the usual targets


def test_a_sample_that_fails_is_one_warning_after_the_summary_and_the_report(hf, tmp_path, monkeypatch, capsys):
    import plait.train.telemetry as telemetry

    there: list[set[str]] = []

    def fails(strategy, bundle, cfg, rt):
        there.append({p.name for p in (tmp_path / "run").iterdir()})
        raise RuntimeError('Error(s) in loading state_dict for Llama:\n\tUnexpected key(s) in state_dict: "x.lora_A"')

    monkeypatch.setattr(telemetry, "generate_sample", fails)
    summary, run = trained(tmp_path / "run", *on_hf(hf, "finetune.lora_rank=4"))
    assert {"summary.json", "report.html"} <= there[0]  # written before the sample was tried
    assert summary["steps"] == 3 and "sample" not in summary and summary["val_loss"] > 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "end-of-run sample" in line] == [
        "warning: the end-of-run sample failed (RuntimeError: Error(s) in loading state_dict for Llama:); the run is "
        "complete (summary.json and the report are written); set train.sample_tokens=0 to skip the sample"]
    assert "run dir:" in out.splitlines()[-1]


FACTORY = '''
from transformers import LlamaForCausalLM


def pretrained(path):
    return LlamaForCausalLM.from_pretrained(path)
'''


def test_a_transformers_factory_from_pretrained_with_lora_trains_and_samples(hf, tmp_path, monkeypatch):
    """It was a 44-line traceback before launch (from_pretrained under the meta device); the sample then crashed
    calling transformers' generate with plait's argument order."""
    (tmp_path / "hf_pretrained_factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    summary, run = trained(tmp_path / "run", "model.factory='hf_pretrained_factory:pretrained'",
                           f"model.options={{path='{hf['dir']}'}}", "data.name='text'", f"data.path='{hf['corpus']}'",
                           f"data.tokenizer='{hf['dir'] / 'tokenizer.json'}'", "finetune.lora_rank=4")
    assert load_config(run / "config.toml").finetune.lora_targets == ["q_proj", "v_proj"]
    assert summary["trainable_params"] == 2 * Q_V
    _, _, model = load_run_model(run)  # the transformers model, adapters merged, its forward giving the logits
    ids = torch.tensor(hf["tok"].encode("def ").astype("int64"))[None]
    with torch.no_grad():
        want = token_by_token(model.eval(), ids, 12, torch.Generator().manual_seed(1234))
    assert want.shape == (1, ids.shape[1] + 12)
    assert summary["sample"] == hf["tok"].decode(want[0].tolist())


def chat_file(path, n: int = 20) -> list[dict]:
    words = CORPUS.split()
    examples = [{"messages": [{"role": "user", "content": " ".join(words[i:i + 4])},
                              {"role": "assistant", "content": " ".join(words[i + 4:i + 9])}]} for i in range(n)]
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return examples


@pytest.fixture(scope="module")
def says_eos(tmp_path_factory):
    """A Llama directory whose every next token is </s>, and a chat JSONL file of 20 conversations."""
    root = tmp_path_factory.mktemp("eos")
    return llama_dir(root / "llama", always_eos=True), chat_file(root / "chat.jsonl"), root / "chat.jsonl"


@pytest.mark.parametrize("prompt", [None, "the red ball"], ids=["held-out", "given"])
def test_a_chat_runs_sample_is_a_turn_through_its_template_and_ends_at_eos(says_eos, tmp_path, prompt):
    """A model whose every next token is </s>: the sample is the prompt alone, rendered as the data was (it was the
    raw "def " followed by twelve </s>)."""
    d, examples, path = says_eos
    given = [f"train.sample_prompt='{prompt}'"] if prompt else []
    summary, _ = trained(tmp_path / "run", f"train.init_from='{d}'", "data.name='chat'", f"data.path='{path}'",
                         "log.report=false", *given)
    if prompt is None:  # the first held-out example (seed 0 splits, a tenth held out): its turns before the reply
        first = min(torch.randperm(len(examples), generator=torch.Generator().manual_seed(0))[:2].tolist())
        messages = examples[first]["messages"][:1]
    else:
        messages = [{"role": "user", "content": prompt}]
    opening = ChatTemplate(TEMPLATE, "<s>", "</s>").render(messages, add_generation_prompt=True)
    assert opening.startswith("<|user|>") and opening.endswith("<|assistant|>")
    tok = HFTokenizer.from_file(d / "tokenizer.json")
    assert summary["sample"] == tok.decode(tok.encode(opening).tolist())
