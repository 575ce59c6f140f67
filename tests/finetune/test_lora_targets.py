"""finetune.lora_targets = [] (the default) takes each model family's usual targets, as peft does (issue 57 item 1):
the query and value projections by the names the family gives them; the job check records them in the config."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from ft_helpers import gpt

from plait.config import load_config
from plait.errors import ConfigError
from plait.finetune import apply_lora, lora_layers, usual_targets
from plait.train.job import check_job


def test_plait_gpt_keeps_its_targets_and_plait_llama_takes_q_proj_and_v_proj(tiny_text):
    cfg = load_config(None, gpt(tiny_text, "finetune.lora_rank=2"))
    assert cfg.finetune.lora_targets == []  # the default says "the model's usual ones"
    check_job(cfg)
    assert cfg.finetune.lora_targets == ["*attn.q", "*attn.v"]
    cfg = load_config(None, gpt(tiny_text, "model.name='llama'", "model.kv_heads=1", "finetune.lora_rank=2"))
    check_job(cfg)
    assert cfg.finetune.lora_targets == ["q_proj", "v_proj"]


def test_transformers_families_take_their_peft_defaults():
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2))
        bert = transformers.BertModel(transformers.BertConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2))
    assert usual_targets(llama) == ["q_proj", "v_proj"]
    assert usual_targets(bert) == ["query", "value"]
    names = apply_lora(llama, 2, 4.0, [])
    assert names == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    assert sorted(lora_layers(llama)) == names


def test_a_model_without_the_usual_names_is_told_to_name_its_layers():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ConfigError) as e:
        apply_lora(model, 2, 4.0, [])
    assert str(e.value) == (
        "finetune.lora_targets = [] takes the attention's query and value projections by their usual names (q_proj "
        "and v_proj, query and value, q and v, ...), and the model has none of them (its Linear layers include 0, 2); "
        "name the layers to adapt, e.g. finetune.lora_targets=['0']")
