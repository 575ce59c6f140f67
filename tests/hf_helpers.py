"""Tiny Hugging Face Llama directories built here, as a user's `train.init_from` is one: transformers' LlamaForCausalLM
with every weight random, a BPE tokenizer trained on local text (tokenizers), a chat template and the special tokens'
ids in config.json. No hub is reachable, and none is needed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = ("the cat sat on the mat and the dog ran to the park where a bird sang in the tree "
          "while children played with a red ball near the old stone wall ") * 30
SPECIAL = ["[UNK]", "<s>", "</s>", "<|user|>", "<|assistant|>"]
# the assistant's turn ends with the end-of-sequence token, as most models' templates end it
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m['role'] == 'assistant' %}"
            "{{ eos_token }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
# what plait never reads, but a tokenizer_config.json and a config.json carry
TOKENIZER_CONFIG = {"chat_template": TEMPLATE, "eos_token": "</s>", "bos_token": "<s>", "model_max_length": 256,
                    "clean_up_tokenization_spaces": False, "tokenizer_class": "PreTrainedTokenizerFast"}


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=120, special_tokens=SPECIAL))
    return tok


def llama_dir(d: Path, std: float = 0.15, seed: int = 0, always_eos: bool = False, **config) -> Path:
    """A LlamaForCausalLM saved with save_pretrained in d (weights ~ N(0, std)), its tokenizer files beside it;
    always_eos: one whose every next token is the end of the sequence (says_eos)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=config.pop("max_position_embeddings", 256),
                      bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"), pad_token_id=None,
                      tie_word_embeddings=False, initializer_range=0.05, **config)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
        if always_eos:
            says_eos(model, tok.token_to_id("</s>"))
    model.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return d


def corpus(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "corpus.txt").write_text(CORPUS)
    return d / "corpus.txt"


def sets(*items: str) -> list[str]:
    """A tiny, quick run's overrides: one process, a few steps, a short context."""
    return ["parallel.dp=1", "model.context=32", "train.steps=3", "train.global_batch_size=4", "train.micro_batch_size=4",
            "train.eval_samples=4", "train.eval_batch_size=4", "train.sample_tokens=12", "log.progress=false",
            "checkpoint.every=3", *items]


def says_eos(model, eos: int) -> None:
    """Make every next token `eos`, whatever the input, with a margin no sampling and no short training undoes: the
    blocks add nothing to the residual stream (o_proj and down_proj zero), every embedding's first coordinate is 1, the
    final norm keeps that coordinate alone (about 4 after the norm), and only eos's row of the head reads it (x 20)."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    model.model.embed_tokens.weight[:, 0] = 1.0
    model.model.norm.weight.zero_()
    model.model.norm.weight[0] = 1.0
    model.lm_head.weight.zero_()
    model.lm_head.weight[eos, 0] = 20.0

