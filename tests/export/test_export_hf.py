"""`plait export --format hf` of a run from a Hugging Face directory writes that checkpoint's config.json,
generation_config.json and tokenizer files back (issue 57 item 2): transformers' generate of the export stops at the
end-of-sequence token where the original's does, even once the source directory is gone; and a LoRA run with the
default targets exports its adapters alone under the targets it recorded."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hf_helpers import corpus, llama_dir, sets
from plait.config import load_config
from plait.export import export, export_hf
from plait.train.trainer import train

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

PROMPT = [5, 9, 14]
NEW = 10


def greedy(model, new: int = NEW, **kw) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor([PROMPT]), max_new_tokens=new, do_sample=False, **kw)[0].tolist()


def eos_at_a_step(d) -> tuple[list[int], int]:
    """Make the greedy continuation of PROMPT reach </s> at a step k >= 3: the head's rows of the token greedy picks
    there and of </s> swap (no earlier step picks either). Returns the tokens before it and k; every step's top two
    logits are at least 1e-2 apart, so the short fine-tuning below cannot turn greedy another way."""
    model = transformers.LlamaForCausalLM.from_pretrained(d).eval()
    eos = model.config.eos_token_id
    ids = greedy(model, NEW, eos_token_id=None)[len(PROMPT):]
    k = next(i for i in range(3, NEW) if ids[i] not in ids[:i] and eos not in ids[:i + 1])
    with torch.no_grad():
        head = model.lm_head.weight
        head[[ids[k], eos]] = head[[eos, ids[k]]]
        logits = model(torch.tensor([PROMPT + ids[:k]])).logits[0, len(PROMPT) - 1:]
    top2 = logits.topk(2).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-2
    model.save_pretrained(d)
    return ids[:k], k


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run (default targets, a learning rate too small to change greedy) from a copy of the directory that is
    removed once the run is over; (run dir, the original directory's files kept aside, tokens before </s>)."""
    root = tmp_path_factory.mktemp("carry")
    d = llama_dir(root / "llama")
    before, _ = eos_at_a_step(d)
    config = json.loads((d / "config.json").read_text())  # remote code the export neither has nor may point at
    (d / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "mine.Model"}}))
    shutil.copytree(d, root / "kept")
    run = root / "run"
    train(load_config(None, sets(f"train.init_from='{d}'", "data.name='text'", f"data.path='{corpus(root)}'",
                                 "finetune.lora_rank=4", "optim.lr=1e-6", "train.sample_tokens=0", "log.report=false")),
          run)
    shutil.rmtree(d)  # the export reads what the run carried
    return run, root / "kept", before


def test_the_export_stops_at_eos_where_the_original_does_and_keeps_its_files(lora_run, tmp_path):
    run, kept, before = lora_run
    out = export_hf(run, tmp_path / "hf")
    original = transformers.AutoModelForCausalLM.from_pretrained(kept).eval()
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    eos = original.config.eos_token_id
    want = greedy(original)
    assert want == PROMPT + before + [eos]  # it stops there, before the NEW tokens
    assert greedy(exported) == want
    config, theirs = json.loads((out / "config.json").read_text()), json.loads((kept / "config.json").read_text())
    assert theirs.pop("auto_map") and "auto_map" not in config
    assert {k: config.get(k) for k in theirs} == theirs  # every field as it was (bos, eos, max_position_embeddings...)
    assert config["plait_checkpoint"] == "step_0000003"
    for name in ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (kept / name).read_bytes(), name


def test_the_adapters_alone_carry_the_targets_the_run_recorded(lora_run, tmp_path):
    from safetensors import safe_open

    run, _, _ = lora_run
    path = export(run, tmp_path / "adapters.safetensors", adapters_only=True)
    with safe_open(str(path), framework="pt") as f:
        meta, names = f.metadata(), sorted(f.keys())
    assert json.loads(meta["plait.lora"]) == {"rank": 4, "alpha": 16.0, "targets": ["q_proj", "v_proj"]}
    assert names == [f"blocks.{i}.attn.{p}.lora_{m}" for i in range(2) for p in ("q_proj", "v_proj") for m in "AB"]


def test_the_python_api_is_the_one_front_door_of_the_hf_export(lora_run, tmp_path):
    """Issue 56 item 5: plait.export(run, out, format="hf") writes what `plait export --format hf` writes; the CLI
    calls it, so its checks are the API's."""
    import plait
    from plait.cli import main
    from plait.errors import ConfigError

    run, _, _ = lora_run
    api = plait.export(run, tmp_path / "api", format="hf")
    assert main(["export", str(run), "-o", str(tmp_path / "cli"), "--format", "hf"]) == 0
    for name in ("config.json", "generation_config.json", "tokenizer.json", "model-00001-of-00001.safetensors"):
        assert (api / name).read_bytes() == (tmp_path / "cli" / name).read_bytes()
    with pytest.raises(ConfigError, match=r"^format 'hf' writes a Hugging Face model directory: name it"):
        plait.export(run, format="hf")
    with pytest.raises(ConfigError, match=r"^format='onnx': plait exports 'safetensors'"):
        plait.export(run, tmp_path / "x", format="onnx")
