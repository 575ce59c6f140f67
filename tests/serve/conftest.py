"""The models the serving tests share, built once per test process (session scope): a random HF Llama with a
word-level BPE tokenizer and a chat template (`hf_dir`), and one with a byte-level BPE (`byte_llama`, every string
is some tokens: structured output and tool calls). Tests that change a directory's files copy it first."""

from __future__ import annotations

import json

import pytest
import torch

from serve.test_serve_openai import CORPUS, TEMPLATE


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """LlamaForCausalLM with every weight drawn at random, a BPE tokenizer trained here, a chat template and an
    end-of-sequence id."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("hf") / "tiny-llama"
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "</s>"]))
    vocab = tok.get_vocab_size()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tok.token_to_id("</s>"), bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    model.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "</s>"}))
    return {"dir": d, "model": model, "tok": tok, "eos": tok.token_to_id("</s>")}


@pytest.fixture(scope="session")
def byte_llama(tmp_path_factory):
    """A LlamaForCausalLM with random weights and a byte-level BPE tokenizer (every string is some tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("bytes") / "llama"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    text = '{"name": "ann", "age": 31, "tags": ["red"], "ok": true} the cat sat on the mat 2024-05-17 ' * 40
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=320, special_tokens=["</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      eos_token_id=tok.token_to_id("</s>"), bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    model.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return d
